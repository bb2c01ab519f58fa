"""Energy per call from NVML's total-energy counter (nvidia-ml-py), around a loop of >= 2 s.

``nvmlDeviceGetTotalEnergyConsumption`` counts millijoules since the driver loaded (Volta and
newer). The counter is read before and after a synchronized loop of repeated calls; the
difference divided by the calls is the energy per call. It is the whole board's energy, idle
power included, so the loop must keep the GPU busy (the calls are queued back to back).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

from twell.bench.timing import run_for


class EnergyUnavailable(RuntimeError):
    """NVML or its energy counter cannot be used here (message says why)."""


@dataclass
class Energy:
    joules: float          # total over the loop
    seconds: float
    calls: int
    joules_per_call: float
    watts: float

    def per_token(self, tokens: int) -> float:
        return self.joules_per_call / tokens

    def as_dict(self) -> dict:
        return asdict(self)


class EnergyMeter:
    """NVML handle of one CUDA device (matched by PCI bus id, so CUDA_VISIBLE_DEVICES is safe)."""

    def __init__(self, device: torch.device | str = "cuda"):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise EnergyUnavailable("energy needs a CUDA device (NVML)")
        try:
            import pynvml
        except ImportError as exc:
            raise EnergyUnavailable(f"nvidia-ml-py is not installed ({exc})") from exc
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise EnergyUnavailable(f"nvmlInit failed: {exc}") from exc
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        self.handle = None
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            bus_id = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
            # nvidia-ml-py releases differ in which of the two names they export
            lookup = getattr(pynvml, "nvmlDeviceGetHandleByPciBusId_v2", None) or getattr(
                pynvml, "nvmlDeviceGetHandleByPciBusId", None)
            try:
                self.handle = lookup(bus_id) if lookup is not None else None
            except pynvml.NVMLError:
                self.handle = None
        if self.handle is None:  # older torch without PCI ids: fall back to the index
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.device = device
        try:
            self.read_mj()
        except pynvml.NVMLError as exc:
            raise EnergyUnavailable(f"NVML total-energy counter not supported on this device: {exc}") from exc

    def read_mj(self) -> int:
        """The counter in millijoules."""
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def measure(self, fn: Callable[[], object], min_seconds: float = 2.0) -> Energy:
        """Energy of calling fn back to back for at least ``min_seconds`` (after one warm-up call)."""
        fn()
        torch.cuda.synchronize(self.device)
        start = self.read_mj()
        calls, seconds = run_for(fn, self.device, min_seconds)
        joules = (self.read_mj() - start) / 1e3
        return Energy(joules, seconds, calls, joules / calls, joules / seconds)
