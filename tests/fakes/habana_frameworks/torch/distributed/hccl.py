"""Fake HCCL: registers an ``hccl`` process-group backend that runs over gloo, and records the order of events.

Habana's HCCL offers SUM, MIN and MAX reductions only (its bridge raises "Unsupported ReduceOp for HCCL process
group" for AVG and PREMUL_SUM). gloo accepts AVG, so the reducing collectives refuse what HCCL refuses whenever the
group runs on the ``hccl`` backend: a test over this double sees what real HCCL would reject."""

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
