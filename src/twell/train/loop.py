"""The training loop: one code path for CPU, one GPU, and torchrun + FSDP2 on many GPUs.

``run(cfg)`` prepares the data (once; token files are memory-mapped), builds the model, applies
activation checkpointing / compile / FSDP from outside, then for each step: gradient
accumulation over micro-batches (CE + coef * L1), clip, AdamW, sparsity tracker, JSONL record,
validation and checkpoints at intervals, a wall-clock guard, and at the end a Hugging Face
export (``<out>/final``) and ``summary.json``.

Output directory (default ``runs/<config name>``)::

    config.yaml  metrics.jsonl  summary.json  ckpt/step_*/ (resumable)  final/ (HF checkpoint)
"""
from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn.functional as F
import yaml

from twell.data.loader import TokenBlocks, TrainOrder, val_block_count, val_shards
from twell.data.prepare import FORMAT_VERSION, PreparedData, prepare_data
from twell.data.budget import check_run_budget
from twell.model import build_model, count_parameters, save_pretrained, set_tracking, sparse_ffns
from twell.paths import repo_root
from twell.train.checkpoint import CheckpointManager
from twell.train.config import RunConfig, load_config
from twell.train.metrics import MetricsLog, atomic_write, json_safe
from twell.train.parallel import (DistInfo, all_ranks_true, all_reduce_sum, apply_activation_checkpointing,
                                  apply_compile, apply_fsdp, barrier, broadcast_flag, broadcast_object, fail_together,
                                  init_distributed, set_gradient_sync, total_grad_norm)
from twell.train.recipe import sparse_lm_loss
from twell.train.schedule import l1_coef_at, lr_at
from twell.train.tracker import SparsityTracker, reinit_dead_gates

# Settings that must not change when a run is resumed (they define the model or the data order).
_RESUME_FIXED = {"model": None, "data": ("source", "tokenizer", "vocab_size", "val_fraction", "split_seed"),
                 "train": ("seq_len", "global_batch", "data_seed", "seed")}
# Sections a resume may change (a longer run, another schedule); the resume event lists what did.
_RESUME_FREE = {"train": None, "optim": None, "sparsity": None}


def _config_diffs(saved: Mapping[str, Any], now: Mapping[str, Any],
                  sections: Mapping[str, Iterable[str] | None]) -> list[tuple[str, Any, Any]]:
    """``(section.key, checkpoint value, current value)`` for the keys that differ (None: every key of the section)."""
    out = []
    for section, keys in sections.items():
        a, b = saved.get(section, {}), now[section]
        out += [(f"{section}.{k}", a.get(k), b.get(k)) for k in (keys or sorted(set(a) | set(b)))
                if a.get(k) != b.get(k)]
    return out


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm stopped the run (summary.json and the last finite checkpoint stay)."""


@dataclass
class RunResult:
    """Where a run's outputs are (``summary`` is the content of summary.json)."""

    out_dir: Path
    metrics_path: Path
    summary_path: Path
    checkpoint_dir: Path | None
    hf_dir: Path | None
    summary: dict


def resolve_compile(setting, device: torch.device) -> tuple[bool, str]:
    """(compile the decoder layers?, why, for "auto") from ``train.compile``: auto compiles on a GPU where
    inductor can generate its kernels (Triton installed), not on a CPU."""
    if setting != "auto":
        return bool(setting), ""
    if device.type != "cuda":
        return False, "auto: not on a CPU"
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False, "auto: Triton is not installed, which torch.compile needs on a GPU"
    return True, "auto"


class Trainer:
    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, overwrite: bool = False):
        self.t_start = time.time()
        self.cfg = cfg
        self.info: DistInfo = init_distributed(cfg.train.device)
        cfg.validate(self.info.world)
        self.out = Path(out_dir)
        self.main = self.info.is_main
        t, s = cfg.train, cfg.sparsity
        self._prepare_out_dir(resume, overwrite)
        self.data = self._prepare_data()
        if self.data.vocab_size > cfg.model.vocab_size or self.data.meta["max_token_id"] >= cfg.model.vocab_size:
            raise ValueError(
                f"vocab mismatch: the tokenizer ({self.data.tokenizer_choice['name']}) has {self.data.vocab_size} "
                f"tokens (max id in the data {self.data.meta['max_token_id']}), but model.vocab_size is "
                f"{cfg.model.vocab_size}; set model.vocab_size >= {self.data.vocab_size} (or data.vocab_size)"
            )
        dev = self.info.device
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = t.tf32
            torch.backends.cudnn.allow_tf32 = t.tf32

        torch.manual_seed(t.seed)  # identical initial weights on every rank and in every rerun
        model = build_model(cfg.model).to(dev)
        self.params = count_parameters(model)
        set_tracking(model, True)
        self.compile, self.compile_note = resolve_compile(t.compile, dev)
        self.calibration = None  # twell.train.calibration.Calibration when sparse_max_active is auto and timed
        self._resuming = resume
        self.sparse_training, self.sparse_note = self._sparse_training(model)
        self._pending_activity = None  # a step's activity on its way to the host (_update_routes)
        if t.activation_checkpointing:
            apply_activation_checkpointing(model)
        if self.compile:
            apply_compile(model)
        self.fsdp = self.info.distributed
        if self.fsdp:
            apply_fsdp(model, self.info, bf16=t.precision == "bf16")
        self.model = model
        self.ffns = sparse_ffns(model)
        self.optimizer = self._build_optimizer()

        self.train_blocks = TokenBlocks(self.data.tokens("train"), t.seq_len, "the training split")
        self.val_blocks = TokenBlocks(self.data.tokens("val"), t.seq_len, "the validation split")
        # the evaluation's settings fail here, not after eval_every steps of training
        val_block_count(self.val_blocks, max_tokens=t.eval_tokens, world=self.info.world,
                        micro_batch=t.eval_micro_batch or t.micro_batch)
        check_run_budget(cfg, self.data)  # data.max_epochs: refuse a run that would repeat tokens
        self.order = TrainOrder(self.train_blocks, t.data_seed, max_epochs=cfg.data.max_epochs)
        self.accum = t.global_batch // (t.micro_batch * self.info.world)
        window = s.dead_window_tokens or cfg.tokens_per_step
        self.tracker = SparsityTracker(cfg.model.num_layers, cfg.model.intermediate_size, t.seq_len,
                                       window_tokens=window, device=dev, position_bins=s.position_bins)
        self.metrics = MetricsLog(self.out / "metrics.jsonl", enabled=self.main)
        self.ckpt = CheckpointManager(self.out / "ckpt", self.info, keep=t.keep_checkpoints)
        self.step = 0
        self.elapsed_before = 0.0  # training seconds of earlier (resumed-from) processes
        self.best_val: dict | None = None
        self.last_val: dict | None = None
        self.stop_reason: str | None = None
        self._last_ckpt: Path | None = None
        self._first_bad = torch.full((), -1, dtype=torch.long, device=dev)  # first non-finite step (device; -1: none)
        if resume:
            self._resume()
        if self.calibration is not None:  # after the resume, which rewrites metrics.jsonl up to its checkpoint
            self._event("ffn-calibration", **self.calibration.as_dict())
        if self.main:  # after the resume checks: a refused resume leaves the run's config.yaml as it was
            (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))

    # -- set-up ----------------------------------------------------------------------------------
    def _sparse_training(self, model) -> tuple:
        """The sparse training backend plugged into every FFN (or None), and why not when not."""
        cfg, mode = self.cfg, self.cfg.train.sparse_kernels
        if mode == "never":
            return None, "train.sparse_kernels is never"
        why = ""
        if self.info.device.type != "cuda":
            why = f"device {self.info.device.type}"
        elif cfg.model.ffn != "relu_gated":
            why = f"model.ffn {cfg.model.ffn} (the kernels train ReLU-gated FFNs)"
        elif mode == "auto" and cfg.sparsity.l1_coef == 0:
            why = "L1 coefficient 0 (a dense baseline; train.sparse_kernels=always forces the kernels)"
        else:
            from twell import kernels

            ok, reason = kernels.available()
            why = "" if ok else f"kernels unavailable: {reason}"
        if why:
            if mode == "always":
                raise ValueError(f"train.sparse_kernels is always but the sparse training kernels cannot run: {why}")
            return None, why
        from twell.nn.sparse_training import SparseTraining, use_sparse_training

        m, source, keep = cfg.train.sparse_max_active, "set", None
        if m == "auto":
            m, source, keep = self._timed_max_active(model)
        # max_active 1 admits any activity: sparse from the first step, before any is measured
        backend = SparseTraining(max_active=m, start="sparse" if m >= 1 else "dense", strict=mode == "always",
                                 min_rows=cfg.train.sparse_min_tokens, threshold_source=source, keep_max=keep)
        return use_sparse_training(model, backend), ""

    def _timed_max_active(self, model) -> tuple[float, str, float | None]:
        """sparse_max_active auto: (threshold, its source, the band's top) from timings of the training op
        against dense at this run's rows per forward (rank 0's, on every rank); the default where nothing is
        timed: forwards below the row floor (they train dense whatever the threshold), or layers the op
        cannot run (they train dense with that reason). A failed timing fails every rank."""
        from twell.nn.sparse_training import MAX_ACTIVE

        t, mc = self.cfg.train, self.cfg.model
        rows = t.micro_batch * t.seq_len
        from twell.train.calibration import Calibration, calibrate, can_time

        if not can_time(sparse_ffns(model), rows, t.sparse_min_tokens):
            return MAX_ACTIVE, "set", None
        cal = err = None
        if self.main:
            shape = dict(rows=rows, D=mc.hidden_size, H=mc.intermediate_size, compiled_dense=self.compile)
            cal = Calibration.from_metrics(self.out / "metrics.jsonl", **shape) if self._resuming else None
            if cal is not None:
                print(f"[twell.train] the run's earlier timing: {cal.why}: threshold {100 * cal.max_active:.2f}%",
                      flush=True)
            else:
                print(f"[twell.train] timing the training op against dense at {rows} rows "
                      "(train.sparse_max_active auto) ...", flush=True)
                try:
                    cal = calibrate(mc.hidden_size, mc.intermediate_size, rows, self.info.device,
                                    compiled_dense=self.compile)
                    print(f"[twell.train] {cal.why}: threshold {100 * cal.max_active:.2f}%", flush=True)
                except Exception as exc:  # every rank raises it, not only this one (the others wait below)
                    err = f"{type(exc).__name__}: {exc}"
        cal, err = broadcast_object((cal, err), self.info)
        if err is not None:
            raise RuntimeError(f"timing the training op for train.sparse_max_active=auto failed ({err}); a number "
                               "in train.sparse_max_active sets the threshold without timing")
        self.calibration = cal
        return cal.max_active, "timed", cal.keep_max

    def _prepare_out_dir(self, resume: bool, overwrite: bool) -> None:
        existing = [p for p in ("ckpt", "metrics.jsonl") if (self.out / p).exists()]
        if existing and not resume and not overwrite:
            raise FileExistsError(f"{self.out} already holds a run ({', '.join(existing)}); pass --resume to continue "
                                  "it or --overwrite to start again")
        with fail_together(self.info):  # the others wait for rank 0's folder, and learn when it failed
            if self.main:
                if overwrite and not resume:
                    for p in ("ckpt", "final"):
                        shutil.rmtree(self.out / p, ignore_errors=True)
                    for p in ("metrics.jsonl", "summary.json"):
                        (self.out / p).unlink(missing_ok=True)
                self.out.mkdir(parents=True, exist_ok=True)

    def _prepare_data(self) -> PreparedData:
        path = None
        with fail_together(self.info):  # rank 0 tokenises while the others wait: its error stops them too
            if self.main:
                path = str(prepare_data(self.cfg.data, vocab_size=self.cfg.model.vocab_size,
                                        progress=self.cfg.train.progress).dir)
        path = broadcast_object(path, self.info)
        with fail_together(self.info):  # e.g. a folder that another node cannot see
            return PreparedData.load(path)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = self.info.device.type == "cuda" and not self.fsdp
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused or None)

    def _resume(self) -> None:
        latest = self.ckpt.resume_point()
        if latest is None:
            # Records of an attempt killed before its first checkpoint would precede a second step 1.
            dropped = self.metrics.truncate_after(-1) if self.main else 0
            self._event("resume-requested", detail=f"no checkpoint found; starting at step 0 with a fresh metrics "
                                                   f"file (dropped {dropped} records of the earlier attempt)")
            return
        state = self.ckpt.read_state(latest)  # checked before any tensor is loaded (a new shape would fail there)
        self._check_resume_config(state["config"])
        self._check_resume_data(state)
        # Weights and optimizer state; the optimizer's settings stay the current config's, as the resume
        # warning below says.
        self.ckpt.load(latest, self.model, self.optimizer)
        self.step = int(state["step"])
        self.tracker.load_state_dict(state["tracker"])
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.best_val = state.get("best_val")
        self.last_val = state.get("last_val")
        if self.main:
            dropped = self.metrics.truncate_after(self.step)
        else:
            dropped = 0
        self._last_ckpt = latest
        changed = [(k, f"{k}: {a!r} -> {b!r}") for k, a, b in _config_diffs(state["config"], self.cfg.to_dict(),
                                                                           _RESUME_FREE)]
        # Allowed (e.g. a longer run), but the learning-rate and L1 schedules follow the new values from here on.
        shaping = [line for k, line in changed
                   if k.startswith(("optim.", "sparsity.l1", "sparsity.reinit")) or k == "train.steps"]
        if shaping and self.main:
            warnings.warn("resuming with settings that change the training from here on: " + "; ".join(shaping),
                          stacklevel=2)
        self._event("resume", detail=f"from {latest.name}; dropped {dropped} records logged after it",
                    changed=[line for _, line in changed])

    def _check_resume_config(self, saved: Mapping[str, Any]) -> None:
        diffs = [f"{k}: checkpoint {a!r} vs now {b!r}"
                 for k, a, b in _config_diffs(saved, self.cfg.to_dict(), _RESUME_FIXED)]
        if diffs:
            raise ValueError("cannot resume: settings that define the model or the data order changed: " + "; ".join(diffs))

    def _check_resume_data(self, state: Mapping[str, Any]) -> None:
        """The data key hashes everything the token files depend on (settings outside _RESUME_FIXED such as
        max_docs, and the source files' size and mtime): another key means other tokens, maybe another tokenizer."""
        saved, now = state.get("data_key"), self.data.meta["key"]
        if saved is None or saved == now:  # None: a checkpoint from before data keys were saved
            return
        diffs = [f"{k}: checkpoint {a!r} vs now {b!r}"
                 for k, a, b in _config_diffs(state["config"], self.cfg.to_dict(), {"data": None})]
        cause = ("changed data settings: " + "; ".join(diffs) if diffs else
                 "no data setting changed, so the source itself did (its files, or the prepared folder given as "
                 "data.source), or the tokenizer directory data.tokenizer names, or twell's prepared-data format "
                 f"(now format {FORMAT_VERSION}, see FORMAT_VERSION in twell/data/prepare.py); which one is unknown")
        raise ValueError(f"cannot resume: the prepared data changed: the checkpoint was trained on data key {saved}, "
                         f"the data now loaded ({self.data.dir}) has key {now}; {cause}. Restore the data the run "
                         "started with, or start a new run (--overwrite or another --out)")

    # -- one step --------------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.train.precision == "bf16" and not self.fsdp:
            return torch.autocast(self.info.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _train_step(self, step: int) -> dict:
        t, o, s = self.cfg.train, self.cfg.optim, self.cfg.sparsity
        lr = lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=t.steps, min_lr_ratio=o.min_lr_ratio)
        coef = l1_coef_at(step, coef=s.l1_coef, warmup_steps=s.l1_warmup_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        dev = self.info.device
        sums = torch.zeros(2, dtype=torch.float64, device=dev)  # ce, l1
        for micro in range(self.accum):
            x, y = self.order.micro_batch(step, micro, rank=self.info.rank, world=self.info.world,
                                          micro_batch=t.micro_batch, global_batch=t.global_batch)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            set_gradient_sync(self.model, micro == self.accum - 1)
            with self._autocast():
                logits = self.model(input_ids=x, use_cache=False).logits
            parts = sparse_lm_loss(logits, y, self.ffns, coef)
            (parts.loss / self.accum).backward()
            self.tracker.observe(self.ffns)
            for f in self.ffns:
                f.stats = None  # drop the L1 graph's references before the next forward
            sums += torch.stack([parts.ce, parts.l1]).double()
            del logits, parts
        grad_norm = total_grad_norm(self.model, o.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = all_reduce_sum(sums, self.info) / (self.accum * self.info.world)
        # Remember the first non-finite step on the device (no host sync here; fit checks it where it syncs anyway).
        # Reduced loss and global norm: every rank sees the same flag and stops at the same step.
        finite = torch.isfinite(sums).all() & torch.isfinite(grad_norm)
        self._first_bad.masked_fill_(~finite & (self._first_bad < 0), step + 1)
        spars = self.tracker.end_step(as_lists=False)
        # Device tensors: converted (one host sync) only for the steps that are logged.
        return {"sums": sums, "grad_norm": grad_norm, "l1_coef": coef, "lr": lr, "ids": x, **spars}

    def _update_routes(self, active_mean: Optional[torch.Tensor]) -> None:
        """Set the layers' routes from a step's activity, one step late: the values reach the host by an
        asynchronous copy and are read at the next step's end, when they have long arrived (None: the end of
        the run, only the pending values). Reading them at once would make every step wait for the GPU (the host
        could not queue the next step ahead), which a run without the kernels never does. The routes are a
        smoothed choice; one step's lag changes little."""
        pending = self._pending_activity
        if active_mean is None:  # the end of the run: only the pending values
            self._pending_activity = None
        elif active_mean.is_cuda:
            host = torch.empty(active_mean.shape, dtype=active_mean.dtype, pin_memory=True)
            host.copy_(active_mean, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(active_mean.device))
            self._pending_activity = (host, ready)
        else:
            self._pending_activity = (active_mean, None)
        if pending is None:
            return
        values, ready = pending
        if ready is not None:
            ready.synchronize()
        self.sparse_training.update(self.ffns, values.tolist())
        # per layer: the route of the next steps, the path the last step ran and why
        routes = self.sparse_training.route_events(self.ffns)
        if routes is not None:
            self._event("ffn-routes", **routes)

    def _time_routes(self, ids: torch.Tensor) -> None:
        """train.sparse_routes timed: each layer's routes timed on its own input of this step's last micro-batch
        (an eager forward without gradients, hooks keeping each SparseFFN's input), then fixed by the timings
        (SparseTraining.set_route); one ``ffn-timed-routes`` event with every layer's record."""
        from twell.nn.ffn import ffn_inputs
        from twell.train.calibration import can_time, time_layer

        t = self.cfg.train
        if not can_time(self.ffns, ids.numel(), t.sparse_min_tokens):
            return  # such forwards (layers) train dense whatever the timings say
        inputs = [None] * len(self.ffns)
        ran = [f.last_route for f in self.ffns]  # the capture's inference routes are not what training ran
        t0 = time.time()
        try:
            with (torch.no_grad(), torch.compiler.set_stance("force_eager"), self._autocast(),
                  ffn_inputs(self.ffns, inputs.__setitem__)):
                self.model(input_ids=ids, use_cache=False)
        finally:
            for f, r in zip(self.ffns, ran):
                f.stats = None
                f.last_route = r
        records = []
        for i, (f, x) in enumerate(zip(self.ffns, inputs)):
            rec, hot = time_layer(x, f.gate_proj.weight, f.up_proj.weight, f.down_proj.weight,
                                  compiled_dense=self.compile, hot_min_freq=t.sparse_hot)
            inputs[i] = None
            self.sparse_training.set_route(f, rec["route"], f"{rec['route']}: {rec['why']}", hot)
            records.append(rec)
        # the next step's ffn-routes event reports the new routes and what they ran
        self._event("ffn-timed-routes", layers=records, seconds=round(time.time() - t0, 3))

    def _log_train(self, raw: dict, bar, t_log: float, step_log: int) -> tuple[float, float, int]:
        """Write the step's JSONL record (one host sync); return (seconds per step since the last record, now, step)."""
        rec = self._to_record(raw)
        now = time.time()
        step_s = (now - t_log) / max(1, self.step - step_log)
        tps = self.cfg.tokens_per_step
        self.metrics.write({
            "kind": "train", "step": self.step, **rec, "tokens": self.step * tps,
            "epoch": self.order.epochs(self.step * self.cfg.train.global_batch), "elapsed_s": self._elapsed(),
            "step_s": step_s, "tok_s": tps / max(step_s, 1e-9), **self._memory(),
        })
        bar.set_postfix(ce=f"{rec['ce']:.3f}", act=f"{100 * rec['active_frac']:.2f}%",
                        tok_s=f"{tps / max(step_s, 1e-9):.0f}", refresh=False)
        return step_s, now, self.step

    def _memory(self) -> dict:
        """Peak GPU memory allocated since the last record (MB), then reset: {} off CUDA."""
        dev = self.info.device
        if dev.type != "cuda":
            return {}
        peak = torch.cuda.max_memory_allocated(dev) / 2**20
        torch.cuda.reset_peak_memory_stats(dev)
        return {"peak_mem_mb": peak}

    def _to_record(self, raw: dict) -> dict:
        ce, l1 = raw["sums"].tolist()
        active = raw["active_mean"].tolist()
        return {"ce": ce, "l1": l1, "loss": ce + raw["l1_coef"] * l1, "l1_coef": raw["l1_coef"], "lr": raw["lr"],
                "grad_norm": float(raw["grad_norm"]), "active_mean": active, "active_max": raw["active_max"].tolist(),
                "dead_frac": raw["dead_frac"].tolist(),
                "active_frac": sum(active) / len(active) / self.cfg.model.intermediate_size}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation CE (mean over tokens) and active neurons per layer on held-out documents."""
        t = self.cfg.train
        self.model.eval()
        dev = self.info.device
        L = self.cfg.model.num_layers
        acc = torch.zeros(2 + L, dtype=torch.float64, device=dev)  # ce sum, tokens, active sums per layer
        for x, y in val_shards(self.val_blocks, max_tokens=t.eval_tokens, rank=self.info.rank, world=self.info.world,
                               micro_batch=t.eval_micro_batch or t.micro_batch):
            x, y = x.to(dev), y.to(dev)
            with self._autocast():
                logits = self.model(input_ids=x, use_cache=False).logits
            acc[0] += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            acc[1] += y.numel()
            acc[2:] += torch.stack([f.stats.active_per_token.sum() for f in self.ffns]).double()
            for f in self.ffns:
                f.stats = None
        self.model.train()
        acc = all_reduce_sum(acc, self.info).tolist()
        ce = acc[0] / acc[1]
        active = [a / acc[1] for a in acc[2:]]
        return {"val_ce": ce, "val_ppl": math.exp(min(ce, 50.0)), "val_tokens": int(acc[1]),
                "val_active_mean": active, "val_active_frac": sum(active) / L / self.cfg.model.intermediate_size}

    # -- the loop --------------------------------------------------------------------------------
    def _event(self, event: str, **kw) -> None:
        self.metrics.write({"kind": "event", "step": self.step, "event": event, **kw})

    def _deadline(self) -> float | None:
        t = self.cfg.train
        limits = [x for x in (t.stop_at_unix, None if t.max_wall_seconds is None else self.t_start + t.max_wall_seconds)
                  if x is not None]
        return min(limits) - t.wall_reserve_s if limits else None

    def _elapsed(self) -> float:
        return self.elapsed_before + (time.time() - self.t_loop)

    def _trainer_state(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "config": self.cfg.to_dict(), "data_key": self.data.meta["key"],
                "elapsed_s": self._elapsed(), "best_val": self.best_val, "last_val": self.last_val}

    def _save(self) -> None:
        self._last_ckpt = self.ckpt.save(self.step, self.model, self.optimizer, self._trainer_state())

    def _validate_and_log(self) -> None:
        v = self.evaluate()
        self.last_val = {"step": self.step, **v}
        if self.best_val is None or v["val_ce"] < self.best_val["val_ce"]:
            self.best_val = {"step": self.step, "val_ce": v["val_ce"]}
        self.metrics.write({"kind": "val", "step": self.step, "elapsed_s": self._elapsed(), **v})

    def fit(self) -> RunResult:
        from twell.progress import progress_bar

        cfg, t, s = self.cfg, self.cfg.train, self.cfg.sparsity
        self.t_loop = time.time()
        if self.main:
            print(self.describe(), flush=True)
        if self.step == 0:
            self._event("start", describe=self.describe())
        deadline = self._deadline()
        bar = progress_bar(total=t.steps, initial=self.step, desc=cfg.name, unit="step",
                           progress=t.progress and self.main, dynamic_ncols=True)
        last_step_s = last_eval_s = 0.0
        last_val_step = self.step if self.last_val and self.last_val["step"] == self.step else None
        t_log, step_log = time.time(), self.step
        while self.step < t.steps:
            raw = self._train_step(self.step)
            self.step += 1
            if self.sparse_training is not None:  # routes change between steps only (checkpoint recomputes agree)
                self._update_routes(raw["active_mean"])
                if t.sparse_routes == "timed" and self.step % t.sparse_retime_every == 0:
                    self._time_routes(raw["ids"])
                    t_log, step_log = time.time(), self.step  # keep the timing out of the step timings
            if s.reinit_dead and self.step % s.reinit_every == 0:
                # The tracker's counters are reduced over ranks; the AND keeps every rank's decision the same anyway.
                dead = all_ranks_true(self.tracker.dead_mask(), self.info)
                gen = torch.Generator().manual_seed(t.seed * 1_000_003 + self.step)  # the same draws on every rank
                n = reinit_dead_gates(self.ffns, dead, self.optimizer, std=cfg.model.init_std, generator=gen)
                self.tracker.revive(dead)
                if self.sparse_training is not None:  # revived neurons change a layer's activity: timings are stale
                    for f, revived in zip(self.ffns, dead.any(1).tolist()):
                        if revived:
                            self.sparse_training.untime(f)
                self._event("reinit", neurons=n, per_layer=dead.sum(1).tolist())
            logged = self.step % t.log_every == 0 or self.step in (1, t.steps)
            if logged:
                last_step_s, t_log, step_log = self._log_train(raw, bar, t_log, step_log)
            due_eval = self.step % t.eval_every == 0 or self.step == t.steps
            due_ckpt = self.step % t.ckpt_every == 0 and self.step < t.steps
            # Checked after a logged record (the host has just synced) and before anything is evaluated or saved.
            if (logged or due_eval or due_ckpt) and self._nonfinite_step() is not None:
                if not logged:
                    self._log_train(raw, bar, t_log, step_log)
                break
            if self.step % s.positions_every == 0 or self.step == t.steps:
                pos = self.tracker.positions()
                if pos:
                    self.metrics.write({"kind": "positions", "step": self.step, **pos})
            if due_eval:
                t_eval = time.time()
                self._validate_and_log()
                last_eval_s = time.time() - t_eval
                last_val_step = self.step
                t_log, step_log = time.time(), self.step  # keep evaluation out of the step timings
            bar.update(1)
            # The next step and an evaluation must end before the deadline: a run evaluates when its eval_every
            # or its last step comes, and a stop evaluates the step it stops at (unless just done). The first
            # evaluation's length is not known before it runs.
            stop = deadline is not None and time.time() + 2 * last_step_s + last_eval_s >= deadline
            if broadcast_flag(stop, self.info) and self.step < t.steps:
                if not logged:
                    self._log_train(raw, bar, t_log, step_log)
                self.stop_reason = f"wall-clock limit (stopped after step {self.step} of {t.steps})"
                self._event("stop", reason=self.stop_reason)
                break
            if due_ckpt:
                self._save()
        bar.close()
        if self._pending_activity is not None:  # the last step's activity: its routes and what it ran, logged
            self._update_routes(None)
        bad = self._nonfinite_step()  # also after a wall-clock stop on an unchecked step
        if bad is not None:
            self._diverged(bad)
        if last_val_step != self.step:
            self._validate_and_log()
        if self._last_ckpt is None or not self._last_ckpt.name.endswith(f"{self.step:07d}"):
            self._save()
        hf_dir = self._export()
        summary = self._summary(hf_dir)
        self._event("end", steps=self.step)
        self.metrics.close()
        barrier(self.info)
        return RunResult(self.out, self.out / "metrics.jsonl", self.out / "summary.json", self._last_ckpt, hf_dir, summary)

    def _nonfinite_step(self) -> int | None:
        """The first step with a non-finite loss or grad norm so far, or None (one host sync)."""
        bad = int(self._first_bad)
        return bad if bad >= 0 else None

    def _diverged(self, bad: int) -> None:
        """Stop without evaluating, saving or exporting the non-finite state: the last finite checkpoint stays."""
        self.stop_reason = (f"non-finite loss or gradient norm at step {bad} (stopped after step {self.step} of "
                            f"{self.cfg.train.steps}; nothing evaluated, saved or exported after it)")
        self._event("stop", reason=self.stop_reason)
        self._summary(None)
        self.metrics.close()
        barrier(self.info)
        last = f"the last checkpoint is {self._last_ckpt}" if self._last_ckpt else "no checkpoint was saved"
        raise TrainingDiverged(f"training diverged: {self.stop_reason}; {last}; see {self.out / 'metrics.jsonl'} and "
                               "summary.json (lower optim.lr or keep optim.grad_clip on)")

    # -- outputs ---------------------------------------------------------------------------------
    def _export(self) -> Path | None:
        """Gather full weights on rank 0 and write a Hugging Face checkpoint to ``<out>/final``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.main:
            return None
        export = build_model(self.cfg.model)
        missing, unexpected = export.load_state_dict(full, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"export: state dict mismatch, missing {missing[:5]}, unexpected {unexpected[:5]}")
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[self.cfg.train.export_dtype]
        eos = self.data.eos_id
        path = save_pretrained(export, self.data.tokenizer(), self.out / "final", self.cfg.train.export_max_shard,
                               dtype=dtype, tokenizer_choice=self.data.tokenizer_choice,
                               extra_config={"eos_token_id": eos, "bos_token_id": eos,
                                             "twell_run": {"name": self.cfg.name, "step": self.step,
                                                           "data": self.data.label}})
        return path

    def describe(self) -> str:
        c, t = self.cfg, self.cfg.train
        epochs = self.order.epochs(t.steps * t.global_batch)
        return (
            f"[twell.train] {c.name}: {self.params['total'] / 1e6:.2f}M params "
            f"({self.params['non_embedding'] / 1e6:.2f}M non-embedding), ffn={c.model.ffn}, "
            f"L1 coef={c.sparsity.l1_coef:g}\n"
            f"  {t.steps} steps x {c.tokens_per_step} tokens/step ({t.global_batch} seqs x {t.seq_len}; micro-batch "
            f"{t.micro_batch} x {self.accum} accumulation x {self.info.world} ranks) = {epochs:.2f} epochs\n"
            f"  data: {self.data.label}: {self.data.meta['n_train_tokens']} train / {self.data.meta['n_val_tokens']} "
            f"val tokens; tokenizer {self.data.tokenizer_choice['kind']} {self.data.tokenizer_choice['name']} "
            f"(vocab {self.data.vocab_size})\n"
            f"  device {self.info.device} ({'FSDP2' if self.fsdp else 'single process'}), precision {t.precision}, "
            f"compile={self.compile}{f' ({self.compile_note})' if self.compile_note else ''}, "
            f"activation checkpointing={t.activation_checkpointing}; sparse training kernels: "
            f"{self.sparse_training or 'no, ' + self.sparse_note}; out {self.out}"
        )

    def _summary(self, hf_dir: Path | None) -> dict:
        if not self.main:
            return {}
        from twell.train.metrics import read_metrics

        recs = read_metrics(self.out / "metrics.jsonl").get("train", [])
        tail = recs[-max(1, min(50, len(recs) // 10)):]
        H, L = self.cfg.model.intermediate_size, self.cfg.model.num_layers
        act = [sum(float(r["active_mean"][l]) for r in tail) / len(tail) for l in range(L)] if tail else []
        wall = time.time() - self.t_start
        dev = self.info.device
        summary = {
            "name": self.cfg.name,
            "description": self.cfg.description,
            "params": self.params,
            "tokens_per_step": self.cfg.tokens_per_step,
            "steps_planned": self.cfg.train.steps,
            "steps_done": self.step,
            "stopped_early": self.stop_reason is not None,
            "stop_reason": self.stop_reason,
            "epochs": self.order.epochs(self.step * self.cfg.train.global_batch),
            "l1_coef": self.cfg.sparsity.l1_coef,
            "data": {"label": self.data.label, "source": self.data.meta["source"]["spec"], "prepared_dir": str(self.data.dir),
                     "n_train_tokens": self.data.meta["n_train_tokens"], "n_val_tokens": self.data.meta["n_val_tokens"],
                     "n_train_docs": self.data.meta["n_train_docs"], "n_val_docs": self.data.meta["n_val_docs"],
                     "tokenizer": self.data.tokenizer_choice},
            "final": {
                "train_ce_last": recs[-1]["ce"] if recs else None,
                "train_ce_tail_mean": sum(float(r["ce"]) for r in tail) / len(tail) if tail else None,
                # the tail is the last records; with log_every > 1 they span more steps than their number
                "tail_records": len(tail),
                "tail_steps": tail[-1]["step"] - tail[0]["step"] + 1 if tail else 0,
                "active_mean_per_layer": act,
                "active_frac_per_layer": [a / H for a in act],
                "active_frac_mean": sum(act) / L / H if act else None,
                "dead_frac_per_layer": recs[-1]["dead_frac"] if recs else None,
                **({k: self.last_val[k] for k in ("val_ce", "val_ppl", "val_active_frac", "val_active_mean", "step")}
                   if self.last_val else {}),
            },
            "best_val": self.best_val,
            "train_seconds": self._elapsed(),
            "process_wall_seconds": wall,
            "tok_s_mean": (self.step * self.cfg.tokens_per_step / self._elapsed()) if self._elapsed() > 0 else None,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "world_size": self.info.world,
            "torch": torch.__version__,
            "paths": {"metrics": str(self.out / "metrics.jsonl"), "hf_checkpoint": str(hf_dir) if hf_dir else None,
                      "train_checkpoint": str(self._last_ckpt) if self._last_ckpt else None},
            "config": self.cfg.to_dict(),
        }
        atomic_write(self.out / "summary.json", json.dumps(json_safe(summary), indent=1))  # NaN as "nan", like metrics
        return summary


def run(cfg: str | Path | Mapping[str, Any] | RunConfig, *, data: str | Path | None = None,
        out: str | Path | None = None, resume: bool = False, overwrite: bool = False,
        overrides: Iterable[str] | Mapping[str, Any] | None = None) -> RunResult:
    """Train ``cfg`` (config name, YAML path, dict or RunConfig) and return where the outputs are.

    data: a corpus path / source string or a prepared data directory (replaces ``data.source``).
    out: output directory (default ``runs/<name>``). resume: continue from its latest checkpoint.
    overwrite: delete an earlier run in ``out`` first. overrides: ``["train.steps=100", ...]``.
    """
    cfg = load_config(cfg, overrides)
    if data is not None:
        cfg.data.source = str(data)
    out = Path(out) if out is not None else repo_root() / "runs" / cfg.name
    trainer = Trainer(cfg, out, resume=resume, overwrite=overwrite)
    return trainer.fit()
