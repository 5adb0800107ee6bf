"""Fake HCCL: registers an ``hccl`` process-group backend that runs over gloo, and records the order of events."""

import torch.distributed as dist

from habana_frameworks import record

record("hccl_imported")


def _create_hccl(store, rank, size, timeout):  # the signature torch passes to a registered backend creator
    record("hccl_process_group_created", rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("hccl", _create_hccl, devices=["cpu", "hpu"])

_real_init = dist.init_process_group


def _recording_init(*args, **kwargs):
    record("init_process_group", kwargs.get("backend", args[0] if args else None))
    return _real_init(*args, **kwargs)


dist.init_process_group = _recording_init
