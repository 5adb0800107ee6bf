"""FSDP2's checkpoint I/O per format: its state dicts (:mod:`.fsdp2_state`), the layout a local checkpoint records
and checks, and loading each format. The engine-neutral parts are in :mod:`..checkpoint`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.checkpoint import fast_load, loading
from lightning_gaudi_fsdp.checkpoint.formats import CheckpointError, CheckpointFormat, merge_groups
from lightning_gaudi_fsdp.checkpoint.trust import storage_reader
from lightning_gaudi_fsdp.checkpoint.views import dcp_model_key
from lightning_gaudi_fsdp.engine import fsdp2_state


def local_layout(model: Module) -> dict[str, Any]:
    """What a local checkpoint records of the model: each parameter's name, shape and dtype."""
    return {"parameters": fsdp2_state.local_layout(model)}


def check_local_layout(path: Path, meta: dict[str, Any], model: Module) -> None:
    saved = [(e["name"], e["shape"]) for e in meta.get("parameters", [])]
    if saved != [(e["name"], e["shape"]) for e in fsdp2_state.local_layout(model)]:
        raise CheckpointError(path, "its parameters (names or shapes) differ from this model's")


def current_state(model: Module, fmt: CheckpointFormat, device_type: str) -> dict[str, Any]:
    """The model's sharded or local state dict, to check a checkpoint against."""
    return fsdp2_state.sharded_template(model) if fmt == "sharded" else model.state_dict()


def load_full_optimizer(model: Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load one full optimizer state (as in a full checkpoint) into ``optimizer`` of the sharded ``model``."""
    if not state.get("state"):
        optimizer.load_state_dict({"state": {}, "param_groups": merge_groups(optimizer, state)})
    else:
        fsdp2_state.load_full_optimizer(model, optimizer, state)


def fast_load_params(model: Module) -> fast_load.Params | None:
    """For :mod:`..checkpoint.fast_load`: each parameter (a DTensor) -> its name and what builds its state; ``None``
    when a parameter is not sharded (torch's path loads that model)."""
    from torch.distributed.tensor import DTensor

    params: fast_load.Params = {}
    for name, param in fsdp2_state.named_parameters(model):
        if not isinstance(param, DTensor):
            return None
        params[id(param)] = ([name], _DTensorState(param))
    return params


class _DTensorState:
    """A parameter's state is a DTensor laid out as the parameter: its local chunk is this rank's piece."""

    def __init__(self, param: Any) -> None:
        self.param = param

    def read_state(
        self, prefixes: list[str], entries: list[Mapping[str, Any]], pieces: fast_load.Pieces
    ) -> dict[str, torch.Tensor] | None:
        def allocate(dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[tuple[int, ...], torch.Tensor]]]:
            tensor = _dtensor_like(self.param, dtype)
            return tensor, fast_load.pieces_of(tensor)

        return fast_load.param_state(prefixes[0], entries[0], tuple(self.param.shape), pieces, allocate)


def _dtensor_like(param: Any, dtype: torch.dtype) -> Any:
    """An empty DTensor laid out as ``param``. State in the parameter's dtype (AdamW's) shares its spec: no autograd
    function and no spec to validate per tensor (``from_local`` cost a third of a millisecond each, half a second for
    an 80-layer Llama's 1446 state tensors); another dtype needs a spec of its own."""
    from torch.distributed.tensor import DTensor

    local = torch.empty(torch_internals.dtensor_local(param).shape, dtype=dtype, device=param.device)
    if dtype == param.dtype:
        return torch_internals.dtensor_with_local(param, local)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def apply_load(
    pending: loading.PendingLoad,
    model: Module,
    optimizers: Sequence[Optimizer],
    *,
    device_type: str,
    strict: bool,
    load_optimizers: bool,
) -> None:
    path = pending.path
    if pending.fmt == "sharded" and loading.load_sharded_fast(
        pending, model, optimizers, strict, load_optimizers, fast_load_params
    ):
        return
    if pending.fmt == "full":
        fsdp2_state.load_full(model, pending.model_state, strict)
    elif pending.fmt == "sharded":
        import torch.distributed.checkpoint as dcp

        key = dcp_model_key(pending.rest)
        state = {key: pending.model_state}
        dcp.load(state, storage_reader=storage_reader(path, weights_only=pending.weights_only))
        fsdp2_state.load_sharded(model, state[key], strict)
    else:
        fsdp2_state.load_local(model, pending.model_state)
    if not load_optimizers:
        return
    if pending.fmt == "sharded":
        _load_sharded_optimizers(pending, model, optimizers)
        return
    if pending.optimizer_states is None:
        return
    loading.check_optimizer_count(path, pending.optimizer_states, optimizers)
    for optimizer, state in zip(optimizers, pending.optimizer_states, strict=True):
        if pending.fmt == "full":
            load_full_optimizer(model, optimizer, state)
        elif not state.get("state"):
            optimizer.load_state_dict({"state": {}, "param_groups": merge_groups(optimizer, state)})
        else:
            fsdp2_state.load_local_optimizer(model, optimizer, state)


def _load_sharded_optimizers(pending: loading.PendingLoad, model: Module, optimizers: Sequence[Optimizer]) -> None:
    import torch.distributed.checkpoint as dcp

    def load_one(key: str, optimizer: Optimizer) -> None:
        state = {key: fsdp2_state.sharded_template(model, optimizer)}
        dcp.load(state, storage_reader=storage_reader(pending.path, weights_only=pending.weights_only))
        fsdp2_state.load_sharded_optimizer(model, optimizer, state[key])

    loading.for_each_sharded_optimizer(pending, optimizers, load_one)
