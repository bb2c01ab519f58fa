#!/usr/bin/env python3
"""Registers / spills / static smem per kernel of every csrc/*.cu (or the given .cu files), sm_90a.

Same compile as tests/test_kernels_compile.py: ``python scripts/ptxas_report.py [file.cu ...]``.
Exit status 1 when a file does not compile or a kernel spills.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install

from twell.kernels.build import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--report", *sys.argv[1:]]))
