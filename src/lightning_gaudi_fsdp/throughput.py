"""Throughput and MFU (model FLOPs utilisation) on Gaudi, in both doors.

Lightning's ``ThroughputMonitor`` (Trainer callback and Fabric utility) computes MFU only where
``lightning.fabric.utilities.throughput.get_available_flops`` knows the device's peak FLOPs, and it knows no HPU.
The two monitors here are Lightning's, with the peak of the Gaudi generation in use supplied as ``available_flops``;
nothing of Lightning is patched. Elsewhere they behave exactly as Lightning's, and :attr:`peak` says why MFU is not
available when it is not (a CPU rehearsal, a dtype Intel publishes no peak for).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.fabric.utilities.throughput import ThroughputMonitor as FabricThroughputMonitor
from lightning.pytorch.callbacks import ThroughputMonitor as TrainerThroughputMonitor
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_gaudi_fsdp import gaudi
from lightning_gaudi_fsdp.adapters import lightning_internals

ComputeDtype = Literal["bf16", "fp8"]

# Peak dense matrix-engine (MME) throughput per card, in FLOP/s. Source: Intel, "Intel Gaudi 3 AI Accelerator White
# Paper" (2024), the table comparing Gaudi 2 and Gaudi 3: MME BF16 432 and 1835 TFLOPs, MME FP8 865 and 1835 TFLOPs
# https://www.intel.com/content/www/us/en/content-details/817486/intel-gaudi-3-ai-accelerator-white-paper.html
# Intel publishes no fp32/fp16 matrix peak there, so MFU is reported for bf16 and fp8 compute only.
PEAK_FLOPS: dict[str, dict[ComputeDtype, float]] = {
    "gaudi2": {"bf16": 432e12, "fp8": 865e12},
    "gaudi3": {"bf16": 1835e12, "fp8": 1835e12},
}
_GENERATION_NAMES = {"gaudi2": "Gaudi 2", "gaudi3": "Gaudi 3"}
_PRECISION_DTYPES: dict[str, ComputeDtype | None] = {
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "transformer-engine": "fp8",
    "transformer-engine-float16": "fp8",
}


@dataclass(frozen=True)
class PeakFlops:
    """The peak a monitor divides by: ``flops`` (FLOP/s per device) or ``None``, and ``reason``: where the figure
    comes from, or why there is none."""

    flops: float | None
    reason: str


def peak_flops(device: torch.device, dtype: ComputeDtype | None) -> PeakFlops:
    """Intel's published peak for ``device`` computing in ``dtype``; on a device that is not a Gaudi, no figure and
    the reason (Lightning's own table covers CUDA and TPU devices)."""
    if device.type != "hpu":
        return PeakFlops(None, f"no published peak FLOPs for {device.type!r} devices in lightning-gaudi-fsdp")
    generation = gaudi.device_generation()
    if generation not in PEAK_FLOPS:
        known = ", ".join(repr(name) for name in PEAK_FLOPS)
        return PeakFlops(None, f"device generation {generation!r} has no published peak here; known: {known}")
    name = _GENERATION_NAMES[generation]
    if dtype is None:
        return PeakFlops(None, f"Intel publishes {name} peaks for bf16 and fp8 only; this run computes in fp32/fp16")
    flops = PEAK_FLOPS[generation][dtype]
    return PeakFlops(flops, f"{name} peak {dtype} {flops / 1e12:g} TFLOP/s (Intel's Gaudi 3 white paper)")


def compute_dtype(precision: str, mixed_precision: Any = None) -> ComputeDtype | None:
    """The dtype the matrix engine computes in: from ``precision`` (``"bf16-mixed"``, ``"bf16-true"``; Intel's
    Transformer Engine computes in fp8), else from FSDP's ``param_dtype`` (a dict, FSDP1's ``MixedPrecision`` or
    FSDP2's ``MixedPrecisionPolicy``); ``None`` for fp32 or fp16 compute."""
    dtype = _PRECISION_DTYPES.get(str(precision))
    if dtype is not None:
        return dtype
    param_dtype = (
        mixed_precision.get("param_dtype")
        if isinstance(mixed_precision, dict)
        else getattr(mixed_precision, "param_dtype", None)
    )
    return "bf16" if param_dtype in (torch.bfloat16, "bf16", "bfloat16") else None


def summary(metrics: Mapping[str, Any], peak: PeakFlops | None, world_size: int, prefix: str = "") -> str | None:
    """One line for people: tokens/s over all devices and MFU, or why there is no MFU, from what a monitor computed
    (``metrics``: its keys, under ``prefix`` such as ``"train/"`` for what the Trainer's logged); ``None`` before the
    monitor's window has filled."""
    tokens = metrics.get(f"{prefix}items_per_sec", metrics.get(f"{prefix}device/items_per_sec"))
    if tokens is None:
        return None
    line = f"throughput: {float(tokens):.0f} tokens/s on {world_size} device(s)"
    mfu = metrics.get(f"{prefix}device/mfu")
    if mfu is not None:
        return f"{line}; MFU {float(mfu):.3f} ({peak.reason if peak else 'Lightning peak'})"
    return f"{line}; MFU not available: {peak.reason}" if peak is not None else line


def _resolve(device: torch.device, precision: str, strategy: Any, dtype: ComputeDtype | None) -> PeakFlops:
    if dtype is not None and dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of 'bf16', 'fp8' or None (from precision)")
    # FSDP1's MixedPrecision (Lightning's attribute) or FSDP2's MixedPrecisionPolicy (the strategy's own)
    config = getattr(strategy, "_config", None)
    mixed = getattr(strategy, "mixed_precision", None) or getattr(config, "mp_policy", None)
    chosen = dtype or compute_dtype(precision, mixed)
    return peak_flops(device, chosen)


class ThroughputMonitor(TrainerThroughputMonitor):
    """Lightning's Trainer ``ThroughputMonitor`` with MFU on Gaudi 2 and Gaudi 3.

    Takes Lightning's arguments (``batch_size_fn``, ``length_fn``, ``window_size``, ...) and logs the same metrics
    (``train/device/items_per_sec``, ``train/device/mfu``, ...); the LightningModule provides ``flops_per_batch``
    as Lightning documents. ``dtype`` (``"bf16"`` or ``"fp8"``) picks the peak to divide by; by default it follows
    ``Trainer(precision=...)`` and the strategy's ``mixed_precision``. After ``setup``, :attr:`peak` holds the figure
    used or the reason there is none, which rank 0 also prints once. On Gaudi, rank 0 waits for the device before
    timing each training and validation batch, as Lightning does on CUDA.
    """

    def __init__(self, *args: Any, dtype: ComputeDtype | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dtype = dtype
        self.peak: PeakFlops | None = None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        device = trainer.strategy.root_device
        self.peak = _resolve(device, trainer.precision_plugin.precision, trainer.strategy, self.dtype)
        if device.type == "hpu":  # elsewhere Lightning's own figure (CUDA, TPU) stands
            self.available_flops = self.peak.flops
            # Lightning's setup built one Throughput per stage from its own (None) figure
            for throughput in lightning_internals.stage_throughputs(self):
                throughput.available_flops = self.peak.flops
        if self.peak.flops:
            rank_zero_info(f"ThroughputMonitor: MFU against the {self.peak.reason}")
        elif self.available_flops:
            rank_zero_info(f"ThroughputMonitor: MFU against Lightning's peak for {device}")
        else:
            rank_zero_info(f"ThroughputMonitor: MFU not available: {self.peak.reason}")

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        self._synchronize(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)

    @override
    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        self._synchronize(trainer)
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, *args)

    @staticmethod
    def _synchronize(trainer: Any) -> None:
        # Lightning synchronizes CUDA before reading its timer; Gaudi queues work the same way. Rank 0 alone times.
        if trainer.is_global_zero and trainer.strategy.root_device.type == "hpu":
            gaudi.synchronize()


class FabricMonitor(FabricThroughputMonitor):
    """Lightning's Fabric ``ThroughputMonitor`` with MFU on Gaudi 2 and Gaudi 3: create it after ``fabric.launch()``
    as ``FabricMonitor(fabric, window_size=...)``, then ``update(...)`` and ``compute_and_log(...)`` as in Lightning.
    ``dtype`` and :attr:`peak` as for :class:`ThroughputMonitor`. Call ``gaudi.synchronize()`` before reading the time
    you pass to ``update`` (work on the device is queued)."""

    def __init__(self, fabric: Any, dtype: ComputeDtype | None = None, **kwargs: Any) -> None:
        super().__init__(fabric, **kwargs)
        self.peak = _resolve(fabric.device, fabric.strategy.precision.precision, fabric.strategy, dtype)
        if fabric.device.type == "hpu":
            self.available_flops = self.peak.flops
