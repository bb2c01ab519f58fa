"""Bad arguments passed straight to the bound C++ functions (bypassing the Python checks): each must
raise a RuntimeError. Session 17 found gate_twell and sparse_ffn ending the process with a segmentation
fault instead (an open defect, csrc/NOTES.md). Run one case per process:
Usage (on the H100): PYTHONPATH=src python -X faulthandler scripts/probes/raw_op_errors.py gate|ffn|sparse|sparse3
"""
import sys, torch
from twell import kernels
which = sys.argv[1]
x = torch.randn(64, 256, device="cuda").bfloat16(); w = torch.randn(300, 256, device="cuda").bfloat16()
g = kernels.twell_gate(x, w)
try:
    if which == "sparse": kernels.load().sparse_ffn(x, w, w, w, 256, 0)
    if which == "gate": kernels.load().gate_twell(x, w, 256, 0)
    if which == "ffn": kernels.load().ffn_forward(x, g.packed, g.spill, None, w, w, 256, 0)
    if which == "sparse3": kernels.load().sparse_ffn(x, w, w, w, 256, 3)
except RuntimeError as e:
    print(which, "raised:", str(e).splitlines()[0][:150])
