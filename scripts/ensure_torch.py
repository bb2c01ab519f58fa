"""Install PyTorch only when none is importable, so set-up never replaces a CUDA build.

On a fresh CPU machine this installs ``torch==2.13.0`` (the CPU wheel that pip finds locally);
an unpinned ``torch`` would pull several GB of CUDA wheels. Override with TWELL_TORCH_SPEC
(e.g. ``TWELL_TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu130"``).

Arguments are passed on to ``pip install``: ``make setup`` passes ``-c <lock>`` so that torch's own
dependencies (filelock, sympy, ...) get the locked versions too. The lock itself leaves torch out.
"""
import os
import shlex
import subprocess
import sys

# The torch that CPU set-up installs; environment.yml pins the same (tests/test_environment.py checks it).
TORCH_SPEC = "torch==2.13.0"


def main(pip_args: list[str]) -> None:
    try:
        import torch  # noqa: F401

        print(f"[setup] keeping installed torch {torch.__version__} (cuda={torch.version.cuda})")
    except ImportError:
        spec = os.environ.get("TWELL_TORCH_SPEC", TORCH_SPEC)
        print(f"[setup] no torch found; installing {spec}")
        subprocess.check_call([sys.executable, "-m", "pip", "install", *pip_args, *shlex.split(spec)])


if __name__ == "__main__":
    main(sys.argv[1:])
