"""Fake HCCL: registers an ``hccl`` process-group backend that runs over gloo, and records the order of events.

As strict as Intel's bridge where a CPU machine can be:

- Intel's ``hccl`` registers for ``hpu`` tensors only: a CPU tensor sent over an ``hccl`` group fails ("No backend
  type associated with device type cpu"). The CPU torch build has no ``hpu`` tensors, so nothing can travel over
  this ``hccl`` at all unless a script sets ``FAKE_HCCL_DEVICES=cpu,hpu`` before importing it (the reductions
  scenario does, to check which reduce ops reach HCCL): say why wherever it is set.
- Lightning (2.3 and later, with torch >= 2.3) binds the default group to the process's device:
  ``init_process_group(..., device_id=root_device)``, ``hpu:0`` on Gaudi. torch's own check of ``device_id`` needs a
  compiled accelerator, which the CPU build lacks, so the double checks it (an ``hpu`` device with index 0: every
  process addresses its device as index 0) and binds the default group to it after creating it, as torch would.
  Groups created later inherit that binding, as on Gaudi.
- Habana's HCCL offers SUM, MIN and MAX reductions only (its bridge raises "Unsupported ReduceOp for HCCL process
  group" for AVG and PREMUL_SUM). gloo accepts AVG, so the reducing collectives refuse what HCCL refuses whenever
  the group runs on the ``hccl`` backend: a test over this double sees what real HCCL would reject."""

import os

import torch
import torch.distributed as dist

from habana_frameworks import record

record("hccl_imported")


def _create_hccl(store, rank, size, timeout):  # the signature torch passes to a registered backend creator
    record("hccl_process_group_created", rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in dist.Backend.backend_list:
    devices = os.environ.get("FAKE_HCCL_DEVICES", "hpu").split(",")
    dist.Backend.register_backend("hccl", _create_hccl, devices=devices)

_real_init = dist.init_process_group


def _recording_init(*args, **kwargs):
    backend = kwargs.get("backend", args[0] if args else None)
    record("init_process_group", backend)
    device_id = kwargs.pop("device_id", None)
    if device_id is None:
        return _real_init(*args, **kwargs)
    device = torch.device(device_id) if not isinstance(device_id, int) else torch.device("hpu", device_id)
    if device.type != "hpu" or device.index != 0:
        raise ValueError(
            f"init_process_group(device_id={device_id!r}): the fake Gaudi bridge addresses each process's device as "
            "hpu:0 (index-based device selection is not supported on HPU)"
        )
    _real_init(*args, **kwargs)
    dist.group.WORLD.bound_device_id = device  # what torch does with device_id on a build with the accelerator
    record("default_group_bound", str(device))
    return None


dist.init_process_group = _recording_init


_HCCL_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX}


def _refuse_unsupported_ops(name):
    real = getattr(dist, name)

    def collective(*args, **kwargs):
        op = kwargs.get("op", dist.ReduceOp.SUM)
        group = kwargs.get("group")
        if dist.get_backend(group) == "hccl" and op not in _HCCL_OPS:
            record("refused_reduce_op", name, str(op))
            raise RuntimeError(f"Unsupported ReduceOp for HCCL process group: {op}")
        return real(*args, **kwargs)

    collective.__wrapped__ = real
    setattr(dist, name, collective)


for _name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "reduce"):
    if hasattr(dist, _name):  # reduce_scatter_single: the entry point FSDP2 uses in newer torch
        _refuse_unsupported_ops(_name)
