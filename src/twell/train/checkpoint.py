"""Training-state checkpoints: written atomically, resumable on any number of ranks.

Layout under ``<out>/ckpt/``::

    step_000100/        torch.distributed.checkpoint (DCP) shards of model + optimizer,
                        plus trainer.pt (step, tracker, config) written last
    latest.json         {"step": 100, "dir": "step_000100"}, replaced atomically

Each checkpoint is written into ``.step_000100.tmp`` and renamed when complete; ``latest.json``
is written to a temporary file and ``os.replace``-d. A kill at any moment leaves either the
previous checkpoint or the new one, never a half-written one that resume would pick.
DCP works without a process group too, so single-process and FSDP runs share this code.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from twell.train.metrics import atomic_write
from twell.train.parallel import DistInfo, barrier

_DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class CheckpointManager:
    def __init__(self, root: str | Path, info: DistInfo, keep: int = 2):
        self.root = Path(root)
        self.info = info
        self.keep = keep

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or None."""
        pointer = self.root / "latest.json"
        if pointer.is_file():
            d = self.root / json.loads(pointer.read_text())["dir"]
            if (d / "trainer.pt").is_file():
                return d
        done = sorted(d for d in self.root.glob("step_*") if (d / "trainer.pt").is_file())
        return done[-1] if done else None

    def save(self, step: int, model, optimizer, trainer_state: dict) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint directory."""
        name = f"step_{step:07d}"
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        barrier(self.info)
        msd, osd = get_state_dict(model, optimizer)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DCP_WARNING)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        barrier(self.info)
        if self.info.is_main:
            state = dict(trainer_state, step=step)
            torch.save(state, tmp / "trainer.pt.tmp")
            os.replace(tmp / "trainer.pt.tmp", tmp / "trainer.pt")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            atomic_write(self.root / "latest.json", json.dumps({"step": step, "dir": name}))
            self._prune(keep_also=final)
        barrier(self.info)
        return final

    @staticmethod
    def read_state(path: str | Path) -> dict:
        """The trainer state (step, tracker, config) of a checkpoint, without its tensors."""
        return torch.load(Path(path) / "trainer.pt", map_location="cpu", weights_only=True)

    def load(self, path: str | Path, model, optimizer) -> None:
        """Restore model weights and optimizer state in place (collective). The optimizer keeps its own
        settings (weight decay, betas, eps, fused/foreach for this machine: the current config's), which
        torch's load would replace by the saved ones; the trainer state is :meth:`read_state`'s."""
        path = Path(path)
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DCP_WARNING)
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for g, kept in zip(optimizer.param_groups, settings):
            g.update(kept)
            on_device = g.get("fused") or g.get("capturable")
            for p in g["params"]:
                st = optimizer.state.get(p, {})
                if torch.is_tensor(st.get("step")):  # fused / capturable keep the step count on the device
                    st["step"] = st["step"].to(p.device if on_device else "cpu")

    def _prune(self, keep_also: Path) -> None:
        done = sorted(d for d in self.root.glob("step_*") if (d / "trainer.pt").is_file())
        for d in done[: max(0, len(done) - self.keep)]:
            if d != keep_also:
                shutil.rmtree(d, ignore_errors=True)
        for d in self.root.glob(".step_*.tmp"):
            shutil.rmtree(d, ignore_errors=True)
