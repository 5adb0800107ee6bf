"""Sharded (DCP) resumes that read each rank's bytes in one pass and put them straight into its shards.

torch's way to resume a sharded checkpoint costs far more than reading it (issue 31, 2 CPU ranks, a Llama of 80
layers: 27x ``torch.load`` of the rank's share with FSDP1): every ``dcp.load`` plans with two collectives, the model
and each optimizer are read in separate passes, FSDP1's ``load_state_dict`` all-gathers each parameter again and its
``optim_state_dict_to_load`` moves and gathers optimizer state parameter by parameter (pytorch#120016, #111096,
#110479), and FSDP2's ``get_optimizer_state_dict`` first runs a step on zero gradients to create state to load into.

Here every rank builds the state it will hold itself: the model entries are views of its live shards (FSDP1: its
slices of each flat parameter, as :func:`.fsdp1_state.model_state_dict` saves them; FSDP2: each parameter's DTensor),
and each optimizer's state tensors are allocated in the shape they have on this rank, wrapped the same way, with the
keys and dtypes the checkpoint's metadata lists. One read in this process alone (no collectives: each rank knows what
it needs) fills all of it, through the same safe reader as every other read (:mod:`.trust`); each optimizer then gets
its state with ``optimizer.load_state_dict`` and the hyper-parameters kept beside the tensors in ``meta.pt``.

:func:`plan` says whether this applies (``None``: the caller takes torch's path): FSDP1 where the package saves
sharded state itself (:func:`.fsdp1_state.supported`), FSDP2 with every parameter a DTensor; every optimizer parameter
under FSDP; only tensors in the optimizer's per-parameter state; the hyper-parameters recorded by this package for
exactly these parameters, group by group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.engine import fsdp1_state, fsdp2


@dataclass
class _Optimizer:
    """One optimizer's part of the read: the DCP template and, per parameter index, the tensors it fills."""

    template: dict[str, Any]
    state: dict[int, dict[str, torch.Tensor]]
    flat_scalars: list[tuple[int, str, list[torch.Tensor]]] = field(default_factory=list)


@dataclass
class Plan:
    """What one rank reads: ``template`` (``{"model": ..., "optimizer_<i>": ...}``) for DCP, and how the optimizer
    entries become each optimizer's state afterwards."""

    template: dict[str, Any]
    optimizers: list[tuple[Optimizer, _Optimizer, list[dict[str, Any]]]]
    live: list[tuple[torch.Tensor, torch.Tensor]]  # (read into, live tensor) where the two are not the same memory


def _saved_entries(metadata: Any) -> dict[str, dict[str, Any]]:
    """The checkpoint's entries grouped by owner: ``"optimizer_0.state.<fqn>"`` -> {``"exp_avg"``: its metadata}."""
    grouped: dict[str, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        owner, _, leaf = key.rpartition(".")
        grouped.setdefault(owner, {})[leaf] = md
    return grouped


def plan(
    model: Module,
    model_state: Mapping[str, Any],
    optimizers: Sequence[Optimizer],
    metadata: Any,
    groups: Sequence[Any],
    *,
    strict: bool,
    load_optimizers: bool,
) -> Plan | None:
    """The read that fills ``model`` (from ``model_state``, the sharded template :func:`.loading.check_load` built)
    and ``optimizers``; ``None`` where torch's path must do it (see the module's docstring)."""
    engine2 = fsdp2.is_fsdp2(model)
    if not (engine2 or fsdp1_state.supported(model)):
        return None
    saved = _saved_entries(metadata)
    keys = set(metadata.state_dict_metadata)
    model_template = {k: v for k, v in model_state.items() if strict or f"model.{k}" in keys}
    template: dict[str, Any] = {"model": model_template}
    live = _live_copies(model, model_template)
    if live is None:
        return None
    planned: list[tuple[Optimizer, _Optimizer, list[dict[str, Any]]]] = []
    if load_optimizers and any(k.startswith("optimizer_") for k in keys):
        params = _fsdp2_params(model) if engine2 else _fsdp1_params(model)
        if params is None:
            return None
        for idx, optimizer in enumerate(optimizers):
            key = f"optimizer_{idx}"
            saved_groups = groups[idx].get("param_groups") if idx < len(groups) else None
            if not any(k.startswith(f"{key}.") for k in keys):
                return None  # torch's path raises its error
            names = [[n for p in g["params"] for n in params.get(id(p), ((), None))[0]] for g in optimizer.param_groups]
            if saved_groups is None or [g.get("params") for g in saved_groups] != names:
                return None
            one = _optimizer_template(optimizer, params, saved, key)
            if one is None:
                return None
            if one.template["state"]:  # an empty entry would be read as a missing one
                template[key] = one.template
            planned.append((optimizer, one, saved_groups))
    return Plan(template, planned, live)


def _live_copies(model: Module, template: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The entries of the template that are not the model's own memory (FSDP1: buffers and parameters FSDP does not
    shard, copied off an accelerator; its sharded entries are views by construction), paired with the local tensor
    they are copied into after the read; ``None`` for an entry that is not one of the model's tensors."""
    from torch.distributed.tensor import DTensor

    from lightning_gaudi_fsdp.checkpoint.layout import _clean

    own = {_clean(n): t for n, t in (*model.named_parameters(), *model.named_buffers())}
    pairs = []
    for key, value in template.items():
        if hasattr(value, "local_shards"):
            continue
        target = own.get(key)
        if (
            not isinstance(value, torch.Tensor)
            or target is None
            or isinstance(value, DTensor) != isinstance(target, DTensor)
        ):
            return None
        if isinstance(value, DTensor):
            value, target = value.to_local(), target.to_local()
        if value.data_ptr() != target.data_ptr() or value.dtype != target.dtype or value.shape != target.shape:
            pairs.append((value, target.detach()))
    return pairs


# ----------------------------------------------------------------------------------------------- optimizer state
# For each parameter the optimizer sees: the names it stands for, and how to build its state's template entries.
_Params = dict[int, tuple[list[str], Any]]


def _fsdp1_params(model: Module) -> _Params | None:
    params: _Params = {}
    for unit in fsdp1_state._units(model):
        if unit.orig_params:
            for param, orig in zip(unit.params, unit.orig_params, strict=True):
                params[id(orig)] = ([param.fqn], ("orig", param))
        else:
            params[id(unit.flat_param)] = ([p.fqn for p in unit.params], ("flat", unit))
    return params


def _fsdp2_params(model: Module) -> _Params | None:
    from torch.distributed.tensor import DTensor

    from lightning_gaudi_fsdp.engine.fsdp2_state import _named_parameters

    params: _Params = {}
    for name, param in _named_parameters(model):
        if not isinstance(param, DTensor):
            return None
        params[id(param)] = ([name], ("dtensor", param))
    return params


def _optimizer_template(optimizer: Optimizer, params: _Params, saved: Mapping[str, Any], key: str) -> _Optimizer | None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    one = _Optimizer({"state": {}}, {})
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in params:
                return None  # a parameter FSDP does not manage: torch's path
            names, (kind, owner) = params[id(p)]
            entries = [saved.get(f"{key}.state.{name}", {}) for name in names]
            if any(not isinstance(md, TensorStorageMetadata) for e in entries for md in e.values()):
                return None  # non-tensor state (a Python number): torch's path unpickles it
            if kind == "flat":
                if not _flat_entries(one, index, owner, names, entries):
                    return None
            elif entries[0]:
                made = _param_entries(kind, owner, entries[0])
                if made is None:
                    return None
                if made[1]:
                    one.template["state"][names[0]] = made[0]
                    one.state[index] = made[1]
            index += 1
    return one


def _param_entries(kind: str, owner: Any, entries: Mapping[str, Any]) -> tuple[dict, dict] | None:
    """The template entries and the state of one original parameter (FSDP1 with ``use_orig_params``, FSDP2): a
    tensor of the parameter's full shape is this rank's piece of it, a 0-dim tensor (``step``) is read whole."""
    template: dict[str, Any] = {}
    state: dict[str, torch.Tensor] = {}
    if kind == "orig" and owner.numel_in_shard == 0:
        return {}, {}  # no element here: FSDP leaves such a parameter without state on this rank, as torch's path
    shape = owner.shape if kind == "orig" else tuple(owner.shape)
    for leaf, md in entries.items():
        dtype = md.properties.dtype
        if tuple(md.size) == ():
            state[leaf] = template[leaf] = torch.empty((), dtype=dtype)
        elif tuple(md.size) != tuple(shape):
            return None
        elif kind == "orig":
            state[leaf] = torch.empty(owner.numel_in_shard, dtype=dtype)
            template[leaf] = fsdp1_state._sharded_tensor(owner, state[leaf])
        else:
            state[leaf] = _dtensor_like(owner, dtype)
            template[leaf] = state[leaf]
    return template, state


def _dtensor_like(param: Any, dtype: torch.dtype) -> Any:
    from torch.distributed.tensor import DTensor

    local = torch.empty(param.to_local().shape, dtype=dtype, device=param.device)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _flat_entries(one: _Optimizer, index: int, unit: Any, names: list[str], entries: list[Mapping[str, Any]]) -> bool:
    """FSDP1 without ``use_orig_params``: the optimizer sees the flat parameter, whose state tensors are this rank's
    whole (padded) flat shard; each original parameter's entry is a view of its elements there. Padding stays zero,
    as it is in training (its gradient is zero)."""
    leaves = {leaf: md for e in entries for leaf, md in e.items()}
    if not leaves:
        return True
    if any(set(e) != set(leaves) for e in entries):
        return False
    state: dict[str, torch.Tensor] = {}
    for leaf, md in leaves.items():
        if tuple(md.size) == ():
            scalars = [torch.empty((), dtype=md.properties.dtype) for _ in names]
            for name, scalar in zip(names, scalars, strict=True):
                one.template["state"].setdefault(name, {})[leaf] = scalar
            one.flat_scalars.append((index, leaf, scalars))
            continue
        flat = torch.zeros(unit.local.numel(), dtype=md.properties.dtype)
        for param, name, entry in zip(unit.params, names, entries, strict=True):
            if tuple(entry[leaf].size) != param.shape:
                return False
            piece = flat[param.offset_in_shard : param.offset_in_shard + param.numel_in_shard]
            one.template["state"].setdefault(name, {})[leaf] = fsdp1_state._sharded_tensor(param, piece)
        state[leaf] = flat
    one.state[index] = state
    return True


# ----------------------------------------------------------------------------------------------------- applying
def apply(planned: Plan, read: Any) -> None:
    """Read everything ``planned`` names with ``read(state)`` (one pass over the files), then put the optimizer state
    and hyper-parameters in place."""
    from lightning_gaudi_fsdp.checkpoint.loading import _merge_groups

    read(planned.template)
    with torch.no_grad():
        for value, target in planned.live:
            target.copy_(value)
    for optimizer, one, groups in planned.optimizers:
        for index, leaf, scalars in one.flat_scalars:
            one.state[index][leaf] = scalars[0]  # the same for every parameter of the unit, as it was saved
        optimizer.load_state_dict(
            {"state": one.state, "param_groups": _merge_groups(optimizer, {"param_groups": groups})}
        )
