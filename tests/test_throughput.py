"""MFU on Gaudi: the peak of the device generation reaches Lightning's throughput metrics in both doors."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from lightning_gaudi_fsdp import GaudiFSDPStrategy, fabric, gaudi
from lightning_gaudi_fsdp.throughput import FabricMonitor, PeakFlops, ThroughputMonitor, peak_flops, summary

pytestmark = pytest.mark.versions  # Lightning's private Throughput list is used: checked on every pairing


def _trainer(accelerator: str, **kwargs) -> L.Trainer:
    kwargs.setdefault("strategy", GaudiFSDPStrategy())
    return L.Trainer(accelerator=accelerator, devices=2, logger=False, **kwargs)


def _monitor_after_setup(trainer: L.Trainer, **kwargs) -> ThroughputMonitor:
    monitor = ThroughputMonitor(batch_size_fn=len, window_size=2, **kwargs)
    trainer.state.fn, trainer.state.stage = TrainerFn.VALIDATING, RunningStage.VALIDATING
    monitor.setup(trainer, L.LightningModule(), "validate")
    return monitor


def _mfu(monitor: ThroughputMonitor, flops_per_batch: float, seconds_per_batch: float) -> float:
    throughput = monitor._throughputs[RunningStage.VALIDATING]  # what the callback logs as validate/device/mfu
    for step in (1, 2):
        throughput.update(time=step * seconds_per_batch, batches=step, samples=step, flops=flops_per_batch)
    return throughput.compute()["device/mfu"]


def test_trainer_on_gaudi2_divides_by_the_bf16_peak(fake_gaudi, monkeypatch, caplog):
    monkeypatch.setenv("FAKE_HPU_NAME", "GAUDI2")
    trainer = _trainer("hpu", precision="bf16-mixed")
    caplog.set_level(logging.INFO)
    monitor = _monitor_after_setup(trainer)
    assert gaudi.device_generation() == "gaudi2"
    assert monitor.available_flops == 432e12
    assert _mfu(monitor, flops_per_batch=216e12, seconds_per_batch=1.0) == pytest.approx(0.5)
    assert "MFU against the Gaudi 2 peak bf16 432 TFLOP/s" in caplog.text


def test_trainer_on_gaudi3_takes_fp8_when_asked_and_bf16_from_mixed_precision(fake_gaudi, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_NAME", "GAUDI3")
    trainer = _trainer("hpu", precision="bf16-mixed")
    assert _monitor_after_setup(trainer, dtype="fp8").available_flops == 1835e12
    strategy = GaudiFSDPStrategy(mixed_precision={"param_dtype": "bf16", "reduce_dtype": "float32"})
    trainer = _trainer("hpu", strategy=strategy)  # 32-true; FSDP computes in bf16
    assert _monitor_after_setup(trainer).available_flops == 1835e12


def test_trainer_monitor_waits_for_the_gaudi_device_before_timing_a_batch(fake_gaudi, monkeypatch):
    trainer = _trainer("hpu", precision="bf16-mixed")
    monitor = _monitor_after_setup(trainer)
    module = L.LightningModule()
    module.flops_per_batch = 1
    monitor.on_validation_start(trainer)
    calls = fake_gaudi()
    before = calls.count(("synchronize",))
    monitor.on_validation_batch_end(trainer, module, None, torch.zeros(2, 3), 0)
    assert calls.count(("synchronize",)) == before + 1


@pytest.mark.fsdp2
def test_fsdp2_mixed_precision_divides_by_the_bf16_peak(fake_gaudi, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_NAME", "GAUDI2")
    strategy = GaudiFSDPStrategy(fsdp_version=2, mixed_precision={"param_dtype": "bf16", "reduce_dtype": "float32"})
    assert _monitor_after_setup(_trainer("hpu", strategy=strategy)).available_flops == 432e12


def test_fp32_compute_and_an_unknown_generation_say_why_there_is_no_mfu(fake_gaudi, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_NAME", "GAUDI3")
    monitor = _monitor_after_setup(_trainer("hpu"))
    assert monitor.available_flops is None
    assert monitor.peak.reason == "Intel publishes Gaudi 3 peaks for bf16 and fp8 only; this run computes in fp32/fp16"
    monkeypatch.setenv("FAKE_HPU_NAME", "GAUDI")
    assert peak_flops(torch.device("hpu", 0), "bf16").reason == (
        "device generation 'gaudi' has no published peak here; known: 'gaudi2', 'gaudi3'"
    )
    with pytest.raises(ValueError, match=r"dtype='fp16' is not supported; expected one of 'bf16', 'fp8'"):
        _monitor_after_setup(_trainer("hpu"), dtype="fp16")


def test_cpu_rehearsal_reports_throughput_and_says_mfu_is_not_available(caplog):
    trainer = _trainer("cpu", precision="bf16-mixed")
    caplog.set_level(logging.INFO)
    monitor = _monitor_after_setup(trainer)
    assert monitor.available_flops is None
    assert "MFU not available: no published peak FLOPs for 'cpu' devices" in caplog.text


def test_fabric_on_gaudi3_divides_by_the_bf16_peak(fake_gaudi, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_NAME", "GAUDI3")
    f = L.Fabric(accelerator="hpu", devices=2, strategy=fabric.GaudiFSDPStrategy(), precision="bf16-mixed")
    f._launched = True  # what fabric.launch() records; the CPU torch build cannot start an hpu process group
    monitor = FabricMonitor(f, window_size=2)
    assert monitor.available_flops == 1835e12
    assert monitor.peak.reason == "Gaudi 3 peak bf16 1835 TFLOP/s (Intel's Gaudi 3 white paper)"
    for step in (1, 2):
        monitor.update(time=step * 2.0, batches=step, samples=step, flops=917.5e12)
    assert monitor.compute()["device/mfu"] == pytest.approx(0.25)


def test_fabric_on_cpu_says_why_there_is_no_mfu():
    f = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    monitor = FabricMonitor(f)
    assert monitor.available_flops is None
    assert monitor.peak.reason == "no published peak FLOPs for 'cpu' devices in lightning-gaudi-fsdp"


def test_summary_line_reads_tokens_per_second_and_mfu_or_why_not():
    gaudi2 = PeakFlops(432e12, "Gaudi 2 peak bf16 432 TFLOP/s (Intel's Gaudi 3 white paper)")
    logged = {"train/items_per_sec": 37440.4, "train/device/items_per_sec": 4680.05, "train/device/mfu": 0.6271}
    assert summary(logged, gaudi2, 8, prefix="train/") == (
        "throughput: 37440 tokens/s on 8 device(s); MFU 0.627 (Gaudi 2 peak bf16 432 TFLOP/s (Intel's Gaudi 3 white "
        "paper))"
    )
    cpu = PeakFlops(None, "no published peak FLOPs for 'cpu' devices in lightning-gaudi-fsdp")
    assert summary({"device/items_per_sec": 438.2}, cpu, 1) == (
        "throughput: 438 tokens/s on 1 device(s); MFU not available: no published peak FLOPs for 'cpu' devices in "
        "lightning-gaudi-fsdp"
    )
    assert summary({"time": 1.0}, cpu, 1) is None  # the window has not filled yet
