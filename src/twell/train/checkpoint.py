"""Training-state checkpoints: written atomically, resumable on any number of ranks.

Layout under ``<out>/ckpt/``::

    step_000100/        torch.distributed.checkpoint (DCP) shards of model + optimizer,
                        plus trainer.pt (step, tracker, config) written last
    latest.json         {"step": 100, "dir": "step_000100"}, replaced atomically

Each checkpoint is written into ``.step_000100.tmp``; once every rank's shards are written (DCP
returns on every rank only after all ranks wrote and rank 0 wrote ``.metadata``), rank 0 writes
``trainer.pt``, the marker of a complete checkpoint, and renames the folder. ``latest.json`` is
written to a temporary file and ``os.replace``-d. A checkpoint is removed (pruned, or replaced by
one of the same step) by renaming it to a hidden name first. So a visible ``step_*`` folder holding
``trainer.pt`` is complete, and a kill at any moment leaves either the previous checkpoint or the
new one, never a half-written or half-deleted one that resume would pick.
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from twell.train.metrics import atomic_write
from twell.train.parallel import DistInfo, barrier, broadcast_object, fail_together

_DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _failures(exc: CheckpointException) -> str:
    """One line per failing rank of a DCP error (its str holds every rank's traceback)."""
    lines = []
    for rank, failure in sorted(exc.failures.items()):
        err = failure[0] if isinstance(failure, tuple) else failure
        lines.append(f"rank {rank}: {type(err).__name__}: {str(err)[:200]}")
    return "; ".join(lines)


class CheckpointManager:
    def __init__(self, root: str | Path, info: DistInfo, keep: int = 2):
        self.root = Path(root)
        self.info = info
        self.keep = keep

    @staticmethod
    def is_complete(path: Path) -> bool:
        """A checkpoint folder with its marker and DCP's metadata (the folder of a killed write has no marker)."""
        return (path / "trainer.pt").is_file() and (path / ".metadata").is_file()

    def latest(self) -> Path | None:
        """The checkpoint ``latest.json`` names when it is complete, else the newest complete one, or None."""
        try:
            d = self.root / json.loads((self.root / "latest.json").read_text())["dir"]
            if d.name.startswith("step_") and self.is_complete(d):
                return d
        except (OSError, ValueError, KeyError, TypeError):  # absent, or cut by a crash of the machine
            pass
        done = sorted(d for d in self.root.glob("step_*") if self.is_complete(d))
        return done[-1] if done else None

    def resume_point(self) -> Path | None:
        """Collective: rank 0's :meth:`latest`, on every rank (every rank resumes from the same checkpoint)."""
        latest = None
        with fail_together(self.info):
            if self.info.is_main:
                latest = self.latest()
        return broadcast_object(latest, self.info)

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
            with open(tmp / "trainer.pt.tmp", "rb") as f:  # contents on disk before the marker is (machine crash)
                os.fsync(f.fileno())
            os.replace(tmp / "trainer.pt.tmp", tmp / "trainer.pt")
            old = self._hide(final) if final.exists() else None  # e.g. a resume from before this step
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
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
            try:
                dcp.load(state, checkpoint_id=str(path))
            except CheckpointException as exc:  # raised on every rank: DCP gathers the ranks' failures
                raise ValueError(f"cannot resume from {path}: its shards do not load ({_failures(exc)}); move that "
                                 "folder away to resume from the checkpoint before it, or start again with "
                                 "--overwrite") from exc
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for g, kept in zip(optimizer.param_groups, settings):
            g.update(kept)
            on_device = g.get("fused") or g.get("capturable")
            for p in g["params"]:
                st = optimizer.state.get(p, {})
                if torch.is_tensor(st.get("step")):  # fused / capturable keep the step count on the device
                    st["step"] = st["step"].to(p.device if on_device else "cpu")

    def _hide(self, path: Path) -> Path:
        """Rename a checkpoint out of resume's sight before deleting it (a half-deleted folder may keep its marker)."""
        hidden = self.root / f".{path.name}.old"
        shutil.rmtree(hidden, ignore_errors=True)
        os.replace(path, hidden)
        return hidden

    def _prune(self, keep_also: Path) -> None:
        done = sorted(d for d in self.root.glob("step_*") if self.is_complete(d))
        for d in done[: max(0, len(done) - self.keep)]:
            if d != keep_also:
                shutil.rmtree(self._hide(d), ignore_errors=True)
        for d in [*self.root.glob(".step_*.tmp"), *self.root.glob(".step_*.old")]:
            shutil.rmtree(d, ignore_errors=True)
