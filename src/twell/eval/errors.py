"""Errors raised on bad evaluation input; each message names the task, file or checkpoint at fault."""
from __future__ import annotations


class UnknownTaskError(ValueError):
    """A task name that this module does not know how to evaluate."""


class TaskDataError(FileNotFoundError):
    """A data directory or data file that was asked for but is missing or unusable."""


class TaskSchemaError(ValueError):
    """A local data file whose rows lack the fields of the hub dataset the task expects."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint (path or hub id) that could not be loaded."""
