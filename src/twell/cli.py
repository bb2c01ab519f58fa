"""What the command-line tools (``twell.train``, ``twell.eval``, ``twell.bench``, ``twell.pipeline``) share: one
way to refuse bad input.

Bad input (an argument, a missing or unreadable file, a setting that cannot run on this machine) is reported the
way argparse reports its own errors: one line ``<prog>: error: <message>`` on stderr and exit status 2, before
any work starts, with a message that says what to change. Status 1 is left to work that ran and failed (a
correctness check, a notebook's cell), so that a script can tell the two apart.

The ``argparse`` types below check numbers and devices while the arguments are parsed, so that a bad value
never gets as far as a loaded model or a started progress bar.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NoReturn

USAGE_STATUS = 2


class UsageExit(SystemExit):
    """SystemExit with status 2 whose ``str()`` is the message (as argparse exits, after printing the line)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = USAGE_STATUS  # the interpreter exits with this, printing nothing more


def error_line(prog: str, message: str) -> str:
    return f"{prog}: error: {message}"


def report(prog: str, message: str) -> int:
    """Print the error line; return the status for ``main`` to return."""
    print(error_line(prog, message), file=sys.stderr)
    return USAGE_STATUS


def fail(prog: str, message: str) -> NoReturn:
    """Print the error line and exit with status 2 (raises :class:`UsageExit`)."""
    report(prog, message)
    raise UsageExit(message)


# -- argparse types ---------------------------------------------------------------------------------------
def _number(text: str, kind: type, what: str):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a positive number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text, float, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def torch_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused when this machine has no such device."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is visible on this machine; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA "
                                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return str(device)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, types: dict) -> None:
    """Apply argparse types to values already parsed (options added by code that gives them none): ``types``
    maps a destination to a type above; a bad value ends in ``parser.error`` as if parsing had found it."""
    for dest, kind in types.items():
        value = getattr(args, dest, None)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is None:
                continue
            try:
                kind(str(item))
            except argparse.ArgumentTypeError as exc:
                parser.error(f"argument --{dest.replace('_', '-')}: {exc}")


def check_kernels(option: str, device: str, instead: str) -> None:
    """ValueError saying why the TwELL kernels cannot serve ``option`` here (``twell.kernels.available()``'s
    reasons, or a device that is not CUDA), naming ``instead``; checked before a model or library is loaded."""
    import torch

    from twell import kernels

    ok, why = kernels.available()
    if not ok:
        raise ValueError(f"{option}: the TwELL kernels cannot run here: {why}; use {instead}")
    if torch.device(device).type != "cuda":
        raise ValueError(f"{option} needs a CUDA device, not {device}; pass --device cuda, or use {instead}")


# -- files ------------------------------------------------------------------------------------------------
def check_checkpoint_files(checkpoint: str | Path | None) -> None:
    """For a local checkpoint directory, ValueError naming the first JSON file in it that does not parse
    (config.json, the tokenizer's, the weight index): loading would fail on it later with the parser's
    message alone. A hub id or a missing path is left to the loader, which says what it expected."""
    if checkpoint is None:
        return
    path = Path(checkpoint)
    if not path.is_dir():
        return
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text())
        except (OSError, ValueError) as exc:  # a JSONDecodeError or UnicodeDecodeError is a ValueError
            raise ValueError(f"{file} cannot be read as JSON ({exc}): the checkpoint is damaged; export or "
                             "copy it again") from None


def check_output_dir(path: Path | None, option: str = "--out") -> None:
    """ValueError when ``path`` exists and is not a directory (the results would fail to be written at the end)."""
    if path is not None and path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file; give a directory")


def check_output_file(path: Path | None, option: str = "--out") -> None:
    """ValueError when ``path`` is an existing directory (the result would fail to be written at the end)."""
    if path is not None and path.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file name (e.g. {path / 'result.json'})")
