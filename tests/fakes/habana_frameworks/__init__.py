"""A test double of Intel's ``habana_frameworks`` package (the parts lightning-gaudi-fsdp uses).

It mirrors the real module names and call signatures, records every call in ``habana_frameworks.CALLS``, and lets a
CPU machine pretend to have Gaudi devices: ``FAKE_HPU_DEVICES`` (default 8) devices of generation ``FAKE_HPU_NAME``
(default ``GAUDI2``, as ``torch.hpu.get_device_name()`` names it), lazy mode read from
``PT_HPU_LAZY_MODE`` when the bridge loads, and an ``hccl`` process-group backend that runs over gloo.
"""

CALLS: list[tuple] = []


def record(*event: object) -> None:
    CALLS.append(tuple(event))
