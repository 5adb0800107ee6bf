"""Fake Habana bridge: loading it adds ``torch.hpu`` (the real bridge loads at ``import torch`` in current releases)."""

import os
import types

import torch

from habana_frameworks import record

__version__ = "1.21.0-fake"
_LAZY_AT_LOAD = os.environ.get("PT_HPU_LAZY_MODE", "0") == "1"
_current = {"device": 0}


def _device_count() -> int:
    return int(os.environ.get("FAKE_HPU_DEVICES", "8"))


def _set_device(index: int) -> None:
    record("set_device", index)
    _current["device"] = index


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
