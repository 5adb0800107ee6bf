"""An ``hpu`` accelerator for Lightning releases that no longer ship one (Lightning >= 2.5.6 / 2.6)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator
from typing_extensions import override

from lightning_gaudi_fsdp import gaudi


class GaudiAccelerator(Accelerator):
    """Intel Gaudi devices as seen through the Habana PyTorch bridge (``torch.hpu``)."""

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "hpu":
            raise ValueError(f"GaudiAccelerator expects an 'hpu' device, got {device}")

    @override
    def teardown(self) -> None:
        pass

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> int:
        if isinstance(devices, list):
            return len(devices)
        if isinstance(devices, str):
            devices = gaudi.device_count() if devices.strip() in ("-1", "auto") else int(devices)
        elif devices == -1:
            devices = gaudi.device_count()
        if not isinstance(devices, int) or devices <= 0:
            raise ValueError(f"devices={devices!r} is not supported for accelerator='hpu'; expected a positive int")
        return devices

    @staticmethod
    @override
    def get_parallel_devices(devices: int) -> list[torch.device]:
        # Every process addresses the device the bridge assigned to it; the index is only a placeholder.
        return [torch.device("hpu", i) for i in range(devices)]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return gaudi.device_count()

    @staticmethod
    @override
    def is_available() -> bool:
        return gaudi.is_available()

    @staticmethod
    def name() -> str:
        return "hpu"

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        hpu = getattr(torch, "hpu", None)
        if hpu is None or not hasattr(hpu, "memory_stats"):
            return {}
        return dict(hpu.memory_stats(device))
