"""The hand-written baselines: plain torch training loops over FSDP1 (``FullyShardedDataParallel``) and FSDP2
(``fully_shard``) with the model, wrapping, settings and data the strategy gets, and the bytes each rank holds.

Rank entry points (``worker.py`` starts one process per rank): ``steps`` times one engine's loop; ``memory``
counts what each rank holds for every ``(engine, sharding)`` pair in ``cfg["configs"]``, one after the other in the
same processes (starting processes costs more than measuring a configuration).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from models import DecoderLayer, batch, build, loss_fn
from torch import nn

# FSDP2 has no NO_SHARD; SHARD_GRAD_OP keeps parameters gathered between forward and backward
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


def shard_fsdp1(model: nn.Module, sharding: str) -> nn.Module:
    """What ``GaudiFSDPStrategy(fsdp_version=1, auto_wrap_policy={DecoderLayer})`` does on CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}),
        sharding_strategy=ShardingStrategy[sharding],
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )


def shard_fsdp2(model: nn.Module, sharding: str) -> nn.Module:
    """What ``GaudiFSDPStrategy(fsdp_version=2, auto_wrap_policy={DecoderLayer})`` does on CPU: ``fully_shard``
    each decoder layer, then the root, over a 1-D mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if sharding not in RESHARD_AFTER_FORWARD:
        raise ValueError(f"sharding={sharding!r} has no FSDP2 form; expected one of {sorted(RESHARD_AFTER_FORWARD)}")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = RESHARD_AFTER_FORWARD[sharding]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def shard(model: nn.Module, engine: str, sharding: str) -> nn.Module:
    return shard_fsdp2(model, sharding) if engine == "fsdp2" else shard_fsdp1(model, sharding)


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the storages this rank holds for parameters, gradients and optimizer state, each storage counted
    once (a view into a flat parameter or a padded shard counts its whole storage). Works for both engines and for
    the models the strategy wraps (the LightningModule under FSDP1's root wrapper, or sharded in place by FSDP2)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp2 = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if fsdp2:
        params, grads = _fsdp2_tensors(fsdp2)
    else:
        flat = [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]
        params = list(flat)
        grads = [getattr(p, "_saved_grad_shard", None) if p.grad is None else p.grad for p in flat]
        grads += [p.grad for p in model.parameters()]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": _storage_bytes(params),
        "grad_bytes": _storage_bytes(grads),
        "optim_bytes": _storage_bytes(states),
    }


def _fsdp2_tensors(modules: list[Any]) -> tuple[list[Any], list[Any]]:
    """Parameter and gradient tensors of FSDP2 modules: the local shards, plus any all-gathered (unsharded) copy
    still allocated, which is what ``reshard_after_forward=False`` keeps between forward and backward."""
    params: list[Any] = []
    grads: list[Any] = []
    for module in modules:
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            sharded = fsdp_param.sharded_param
            params.append(sharded)
            params += getattr(fsdp_param, "all_gather_outputs", [])
            grads.append(sharded.grad)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            grads.append(None if unsharded is None else unsharded.grad)
    return params, grads


def _storage_bytes(tensors: list[Any]) -> int:
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t is None or not t.numel():
            continue
        storage = t.untyped_storage()
        if storage.nbytes():  # FSDP frees an unsharded copy by resizing its storage to 0
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """Wall-clock and CPU seconds (this process, all threads) of each step."""
    times, cpu = [], []
    for step in range(cfg["steps"]):
        start, start_cpu = time.perf_counter(), time.process_time()
        # zero_grad first, as Lightning's closure does: after the last step each rank still holds its gradients
        optimizer.zero_grad()
        loss = loss_fn(model, batch(cfg["size"], step, rank))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"step_times": times, "step_cpu": cpu}


def steps(rank: int, cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world_size"])  # MASTER_ADDR/PORT: worker.py
    torch.manual_seed(0)
    model = shard(build(cfg["size"]), cfg.get("engine", "fsdp1"), cfg.get("sharding", "FULL_SHARD"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    result: dict[str, Any] = {**_train(model, optimizer, cfg, rank), **held_bytes(model, optimizer)}
    _finish(rank, cfg, result)


def memory(rank: int, cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world_size"])
    result: dict[str, Any] = {}
    for engine, sharding in cfg["configs"]:
        torch.manual_seed(0)
        model = shard(build(cfg["size"]), engine, sharding)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _train(model, optimizer, cfg, rank)
        result[f"{engine}:{sharding}"] = held_bytes(model, optimizer)
        del model, optimizer
        gc.collect()
        dist.barrier()
    _finish(rank, cfg, result)


def _finish(rank: int, cfg: dict[str, Any], result: dict[str, Any]) -> None:
    gathered: list[Any] = [None] * cfg["world_size"]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(cfg["result"]).write_text(json.dumps({"ranks": gathered}))
    dist.barrier()
    os._exit(0)  # results are written; tearing gloo down sometimes ends in std::terminate
