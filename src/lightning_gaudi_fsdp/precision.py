"""FSDP precision that autocasts on the device actually in use and clips by the global norm.

Lightning's ``FSDPPrecision`` (the Trainer's and Fabric's alike) hard-codes ``torch.autocast("cuda")`` (so
``bf16-mixed`` silently runs in fp32 on CPU and Gaudi) and builds its gradient scaler for CUDA; the Trainer's also
refuses ``gradient_clip_algorithm="norm"``. :class:`GaudiFSDPPrecision` (Trainer) and
:class:`GaudiFabricFSDPPrecision` (Fabric) fix that with one mixin; the strategy tells them the root device type and
the wrapped root module during setup.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as FabricFSDPPrecision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gaudi_fsdp import _sharding

_LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class _OnDevice:
    """Autocast and gradient scaling on the device in use; mixed into both of Lightning's ``FSDPPrecision``."""

    precision: Any
    scaler: Any

    def __init__(self, precision: Any, scaler: Any = None, device_type: str = "cpu") -> None:
        with warnings.catch_warnings():
            # Lightning builds a CUDA scaler for "16-mixed", which warns and disables itself off CUDA; it is
            # replaced below by one for the device actually in use.
            warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
            # Lightning's FSDPPrecision checks the scaler against self.precision before assigning it (its class
            # default "32-true"), so it refuses every scaler; set it first so a scaler for "16-mixed" gets through.
            self.precision = precision
            super().__init__(precision, scaler=scaler)
        if scaler is not None:
            self.scaler = scaler  # Lightning's __init__ keeps only the scaler it builds itself
        self._default_scaler = scaler is None
        self.device_type = device_type
        self._fsdp_root: Module | None = None
        self._engine: Any = None
        self.set_device_type(device_type)

    def set_device_type(self, device_type: str) -> None:
        self.device_type = device_type
        if self.precision == "16-mixed" and self._default_scaler:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device_type)

    def attach(self, fsdp_root: Module, engine: Any) -> None:
        self._fsdp_root = fsdp_root
        self._engine = engine

    def forward_context(self) -> AbstractContextManager:
        dtype = _LOW_PRECISION.get(self.precision)
        if dtype is not None:
            return torch.autocast(self.device_type, dtype=dtype)
        return super().forward_context()  # type: ignore[misc]


class GaudiFSDPPrecision(_OnDevice, FSDPPrecision):
    """The Trainer's FSDP precision plugin; also clips by the global norm."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:  # type: ignore[override]
        _sharding.clip_grad_norm(self._engine, self._fsdp_root, clip_val)


class GaudiFabricFSDPPrecision(_OnDevice, FabricFSDPPrecision):
    """Fabric's FSDP precision plugin (Fabric clips in the strategy)."""


def adopt(plugin: Any, lightning_cls: type, gaudi_cls: type) -> Any:
    """The precision plugin a strategy keeps: ``plugin`` if it is already ours, ``gaudi_cls`` in place of Lightning's
    ``lightning_cls`` (its connector builds one with CUDA autocast and scaler), a ``TypeError`` for anything else.
    (A custom scaler cannot arrive this way: Lightning's FSDPPrecision refuses any scaler argument.)"""
    if plugin is not None and not isinstance(plugin, lightning_cls):
        raise TypeError(f"GaudiFSDPStrategy works with FSDP precision plugins only, got {type(plugin).__name__}")
    if isinstance(plugin, lightning_cls) and not isinstance(plugin, gaudi_cls):
        plugin = gaudi_cls(plugin.precision)
    return plugin
