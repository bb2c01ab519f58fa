"""Install PyTorch only when none is importable, so set-up never replaces a CUDA build.

On a fresh CPU machine this installs ``torch==2.13.0`` (the CPU wheel that pip finds locally);
an unpinned ``torch`` would pull several GB of CUDA wheels. Override with TWELL_TORCH_SPEC
(e.g. ``TWELL_TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu130"``).
"""
import os
import shlex
import subprocess
import sys

try:
    import torch  # noqa: F401

    print(f"[setup] keeping installed torch {torch.__version__} (cuda={torch.version.cuda})")
except ImportError:
    spec = os.environ.get("TWELL_TORCH_SPEC", "torch==2.13.0")
    print(f"[setup] no torch found; installing {spec}")
    subprocess.check_call([sys.executable, "-m", "pip", "install", *shlex.split(spec)])
