"""Fake Habana bridge: loading it adds ``torch.hpu`` (the real bridge loads at ``import torch`` in current releases).

``torch.hpu.current_device()`` is always 0 and ``set_device`` accepts index 0 only: each process addresses the one
device it acquired as ``hpu:0``, as with Intel's bridge."""

import os
import types

import torch

from habana_frameworks import record

__version__ = "1.21.0-fake"
_LAZY_AT_LOAD = os.environ.get("PT_HPU_LAZY_MODE", "0") == "1"
_current = {"device": 0}


def _device_count() -> int:
    return int(os.environ.get("FAKE_HPU_DEVICES", "8"))


def _set_device(device) -> None:
    # Each process sees the one device it acquired as index 0 (HABANA_VISIBLE_MODULES picks which); Intel's bridge
    # does not select devices by index.
    index = device.index if isinstance(device, torch.device) else device
    record("set_device", index)
    if index not in (None, 0):
        raise RuntimeError(f"torch.hpu.set_device({device!r}): index based device selection is not supported on HPU")
    _current["device"] = 0


hpu = types.ModuleType("torch.hpu")
hpu.is_available = lambda: _device_count() > 0
hpu.device_count = _device_count
hpu.current_device = lambda: _current["device"]
hpu.set_device = _set_device
hpu.get_device_name = lambda device=None: os.environ.get("FAKE_HPU_NAME", "GAUDI2")  # the real bridge: GAUDI2, GAUDI3
hpu.synchronize = lambda device=None: record("synchronize")
hpu.memory_stats = lambda device=None: {"fake_bytes_in_use": 0}
torch.hpu = hpu
record("bridge_loaded", "lazy" if _LAZY_AT_LOAD else "eager")
