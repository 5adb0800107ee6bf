"""State dicts of an FSDP2 model in the package's three checkpoint formats, written so that the files on disk are
the ones FSDP1 writes: checkpoints cross engines.

- ``full``: plain tensors gathered on rank 0 under the parameter names, optimizer state keyed by parameter id in
  ``model.parameters()`` order (torch's standard form), as FSDP1 with ``use_orig_params=True`` writes it.
- ``sharded``: DTensors (model) and DTensor optimizer state keyed by parameter name, which DCP stores under the same
  keys as FSDP1's sharded state dicts, so either engine reads the other's (and reshards).
- ``local``: each rank's local shard of every parameter and of its optimizer state, as plain tensors.

torch's ``torch.distributed.checkpoint.state_dict`` does the sharding, and the gathering where the package's own does
not apply: for ``full``, each rank sends its dim-0 chunk of every parameter and optimizer state straight into a full
tensor on rank 0 (``pieces.gather_pieces``, shared with FSDP1), where torch all-gathers every tensor on
every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name
from lightning_gaudi_fsdp.engine.pieces import (
    carries_host_tensors,
    chunk_spans,
    gather_pieces,
    optimizer_state_by_id,
    optimizer_state_by_name,
    param_groups_by_id,
)

if TYPE_CHECKING:
    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream


def is_fsdp2(model: Module) -> bool:
    """Whether ``model`` holds modules sharded by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def named_parameters(model: Module) -> list[tuple[str, Any]]:
    """Parameter names as state dicts spell them (no activation-checkpointing wrapper prefixes)."""
    return [(clean_name(name), p) for name, p in model.named_parameters()]


def parameter_names(model: Module) -> list[str]:
    """Names of ``model.parameters()`` in order: the ids of a full optimizer state."""
    names = {id(p): name for name, p in named_parameters(model)}
    return [names[id(p)] for p in model.parameters()]


def _to_local(value: Any) -> Any:
    """Local shards as plain host tensors: moved, not copied, when already on the CPU (a synchronous save writes them
    before training goes on; an asynchronous one stages them into its own buffers first)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().to("cpu")
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, Mapping):
        return {k: _to_local(v) for k, v in value.items()}
    return value


class _Layout(NamedTuple):
    """Where each rank's dim-0 chunk of a parameter lies in the flattened parameter (FSDP2 cuts as ``torch.chunk``)."""

    shape: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]


def _layout(shape: tuple[int, ...], world_size: int) -> _Layout:
    return _Layout(shape, chunk_spans(shape[0], world_size, math.prod(shape[1:])))


def _gathers_to_rank0(model: Module) -> bool:
    """Whether :func:`full_model_state_dict` applies: every parameter a DTensor sharded on dim 0 over a 1-D mesh of
    all ranks of the default group, in host memory, and a default group that carries them (the pieces travel over it:
    :func:`~.pieces.carries_host_tensors`, not ``hccl``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not (dist.is_available() and dist.is_initialized()) or not carries_host_tensors():
        return False
    ranks = list(range(dist.get_world_size()))
    return all(
        isinstance(p, DTensor)
        and p.dim() > 0
        and tuple(p.placements) == (Shard(0),)
        and p.device_mesh.ndim == 1
        and p.device_mesh.mesh.tolist() == ranks
        and p.to_local().device.type == "cpu"
        for p in model.parameters()
    )


def _full_pieces(values: list[Any], stream: FullStream | None = None) -> list[Any]:
    """Each DTensor of ``values`` as a full host tensor on rank 0 (``None`` on the others), each rank sending its
    chunk straight into it (with ``stream``: a placeholder, filled when the stream writes); anything else as it is."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    world_size = dist.get_world_size()
    pieces = []
    for value in values:
        if isinstance(value, DTensor):
            layout = _layout(tuple(value.shape), world_size)
            local = value.to_local().detach().reshape(-1)
            lo, hi = layout.spans[dist.get_rank()]
            if local.numel() != hi - lo:
                raise RuntimeError(
                    f"a DTensor of shape {tuple(value.shape)} holds {local.numel()} elements here, not {hi - lo}"
                )
            pieces.append((layout, local, range(world_size), value.dtype))
    gathered = iter(gather_pieces(pieces, stream))
    return [next(gathered) if isinstance(v, DTensor) else v for v in values]


def full_model_state_dict(model: Module, stream: FullStream | None = None) -> dict[str, Any]:
    """The full model state dict on rank 0 (``{}`` elsewhere), as ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)`` gives it, without its all-gather of every parameter on every rank."""
    import torch.distributed as dist

    state = model.state_dict()
    values = _full_pieces([v.detach() if isinstance(v, torch.Tensor) else v for v in state.values()], stream)
    if dist.get_rank() != 0:
        return {}
    return {
        clean_name(key): value.to("cpu") if isinstance(value, torch.Tensor) else value
        for key, value in zip(state, values, strict=True)
    }


def full_optimizer_state_dict(model: Module, optimizer: Optimizer, stream: FullStream | None = None) -> dict[str, Any]:
    """The full optimizer state on rank 0 (``{}`` elsewhere) keyed by the index of each parameter in
    ``model.parameters()``, as torch's full optimizer state dict rekeyed by :func:`.pieces.optimizer_state_by_id`,
    gathered as :func:`full_model_state_dict` gathers weights."""
    import torch.distributed as dist

    ids = {id(p): i for i, p in enumerate(model.parameters())}
    entries = [
        (ids[id(p)], key, value.detach() if isinstance(value, torch.Tensor) else value)
        for group in optimizer.param_groups
        for p in group["params"]
        for key, value in optimizer.state.get(p, {}).items()
    ]
    values = _full_pieces([value for _, _, value in entries], stream)
    if dist.get_rank() != 0:
        return {}
    state: dict[int, dict[str, Any]] = {}
    for (index, key, _), value in zip(entries, values, strict=True):
        state.setdefault(index, {})[key] = value.to("cpu") if isinstance(value, torch.Tensor) else value
    return {"state": state, "param_groups": param_groups_by_id(optimizer.param_groups, ids)}


def model_state_dict(model: Module, fmt: str, stream: FullStream | None = None) -> dict[str, Any]:
    """``stream``: see :func:`full_model_state_dict` (used only where the package gathers a full state)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if fmt == "full" and _gathers_to_rank0(model):
        return full_model_state_dict(model, stream)
    if fmt == "full":
        return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))
    if fmt == "local":
        # The module's own names, which load_local looks up again; torch's get_model_state_dict would map every
        # parameter's name first (about 20 ms here, on every save), for nothing a local checkpoint uses.
        return _to_local(model.state_dict())
    return get_model_state_dict(model)


def optimizer_state_dict(
    model: Module, optimizer: Optimizer, fmt: str, rank: int, stream: FullStream | None = None
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if fmt == "local":
        return _to_local(optimizer.state_dict())
    if fmt == "sharded":
        return get_optimizer_state_dict(model, optimizer)
    if _gathers_to_rank0(model):
        return full_optimizer_state_dict(model, optimizer, stream)
    state = get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return {}
    return optimizer_state_by_id(state, parameter_names(model))


def expected_full_shapes(model: Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in named_parameters(model)}


def load_full(model: Module, state: Mapping[str, Any], strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, dict(state), options=_options(full_state_dict=True, strict=strict))


def load_full_optimizer(model: Module, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    named = optimizer_state_by_name(state, parameter_names(model))
    set_optimizer_state_dict(model, optimizer, named, options=_options(full_state_dict=True))


def sharded_template(model: Module, optimizer: Optimizer | None = None) -> dict[str, Any]:
    """The sharded state to load a DCP checkpoint into (optimizer state is initialised first if empty)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if optimizer is None:
        return get_model_state_dict(model)
    return get_optimizer_state_dict(model, optimizer)


def load_sharded(model: Module, state: Mapping[str, Any], strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, dict(state), options=_options(strict=strict))


def load_sharded_optimizer(model: Module, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, dict(state))


def load_local(model: Module, state: Mapping[str, Any]) -> None:
    """Copy each saved local shard into this rank's shard of the parameter (or buffer) of the same name."""
    from torch.distributed.tensor import DTensor

    current = model.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            target = current[name]
            (target.to_local() if isinstance(target, DTensor) else target).copy_(value)


def load_local_optimizer(model: Module, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    """Load ``optimizer.state_dict()`` saved as local tensors: each state tensor shaped like its parameter's shard
    becomes a DTensor on that parameter's mesh again."""

    params = [p for group in optimizer.param_groups for p in group["params"]]
    restored: dict[Any, Any] = {}
    for key, entry in state["state"].items():
        param = params[key]
        restored[key] = {k: _as_shard_of(param, v) for k, v in entry.items()}
    optimizer.load_state_dict({"state": restored, "param_groups": state["param_groups"]})


def _as_shard_of(param: Any, value: Any) -> Any:
    """``value`` as a DTensor laid out like ``param`` when it is that parameter's local shard (e.g. AdamW's
    ``exp_avg``); anything else (a scalar ``step``) as it is."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0):
        return value
    if value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(
        value.to(param.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,  # FSDP2 shards unevenly (torch.chunk): the global shape cannot be inferred
        stride=param.stride(),
    )


def local_layout(model: Module) -> list[dict[str, Any]]:
    """What a local FSDP2 checkpoint records to be checked and joined offline: each parameter's global shape, dtype,
    placements and mesh shape (FSDP2 shards dim 0 the way ``torch.chunk`` does, over the mesh's last dimension)."""
    from torch.distributed.tensor import DTensor

    return [
        {
            "name": name,
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
            "placements": [str(pl) for pl in p.placements] if isinstance(p, DTensor) else [],
            "mesh": list(p.device_mesh.shape) if isinstance(p, DTensor) else [],
        }
        for name, p in named_parameters(model)
    ]
