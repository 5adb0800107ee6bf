"""FSDP precision that autocasts on the device actually in use and clips by the global norm.

Lightning's ``FSDPPrecision`` hard-codes ``torch.autocast("cuda")`` (so ``bf16-mixed`` silently runs in fp32 on CPU and
Gaudi), builds its gradient scaler for CUDA, and refuses ``gradient_clip_algorithm="norm"``. This subclass fixes the
three; the strategy tells it the root device type and the wrapped root module during setup.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

_LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class GaudiFSDPPrecision(FSDPPrecision):
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
        self.set_device_type(device_type)

    def set_device_type(self, device_type: str) -> None:
        self.device_type = device_type
        if self.precision == "16-mixed" and self._default_scaler:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device_type)

    def attach(self, fsdp_root: Module) -> None:
        self._fsdp_root = fsdp_root

    @override
    def forward_context(self) -> AbstractContextManager:
        dtype = _LOW_PRECISION.get(self.precision)
        if dtype is not None:
            return torch.autocast(self.device_type, dtype=dtype)
        return super().forward_context()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:  # type: ignore[override]
        # torch.nn.utils.clip_grad_norm_ on a shard sees only that rank's share of the norm; FSDP's root
        # module computes the norm over all shards and all ranks.
        if self._fsdp_root is None:
            raise RuntimeError("gradient clipping by norm needs the FSDP-wrapped model; the strategy is not set up")
        from lightning_gaudi_fsdp.engine import fsdp2

        if fsdp2.is_fsdp2(self._fsdp_root):
            fsdp2.clip_grad_norm_(self._fsdp_root, clip_val)  # DTensor gradients: the norm spans every rank
        else:
            self._fsdp_root.clip_grad_norm_(clip_val)  # type: ignore[operator]
