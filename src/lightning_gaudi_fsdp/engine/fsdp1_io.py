"""FSDP1's checkpoint I/O per format: its state dicts (the package's own where :mod:`.fsdp1_state` applies, torch's
state-dict contexts otherwise), the layout a local checkpoint records and checks, and loading each format. The
engine-neutral parts (detection, saving, checking keys, agreeing) are in :mod:`..checkpoint`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.adapters import fsdp1_internals, torch_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name, join_name
from lightning_gaudi_fsdp.checkpoint import fast_load, loading
from lightning_gaudi_fsdp.checkpoint.formats import CheckpointError, CheckpointFormat, merge_groups
from lightning_gaudi_fsdp.checkpoint.layout import FLAT_PARAM, flat_param_layout, fsdp_units
from lightning_gaudi_fsdp.checkpoint.trust import storage_reader
from lightning_gaudi_fsdp.checkpoint.views import dcp_model_key
from lightning_gaudi_fsdp.engine import fsdp1_state

if TYPE_CHECKING:
    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream


# ---------------------------------------------------------------------------------------------- state dicts
def state_dict_context(
    model: Module, fmt: CheckpointFormat, device_type: str, rank0_only: bool = True
) -> AbstractContextManager:
    """FSDP's state-dict context for ``fmt``. Shards that already live on the CPU are not offloaded again: with
    ``offload_to_cpu=True`` torch 2.13 frees memory it still reads while building a full state dict on CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    offload = device_type != "cpu"
    if fmt == "full":
        configs: tuple[Any, Any, Any] = (
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        )
    elif fmt == "sharded":
        configs = (
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=offload),
            ShardedOptimStateDictConfig(offload_to_cpu=offload),
        )
    else:
        configs = (StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(), LocalOptimStateDictConfig())
    return FSDP.state_dict_type(model, *configs)


def _managed_names(model: Module) -> set[str]:
    return {f"{e['prefix']}.{f}" if e["prefix"] else f for e in flat_param_layout(model) for f in e["fqns"]}


def model_state_dict(
    model: Module, fmt: CheckpointFormat, device_type: str, stream: FullStream | None = None
) -> dict[str, Any]:
    """The model's state in ``fmt`` (empty on ranks other than 0 for ``full``). ``stream``: where the package gathers
    a full state itself, plan the gather on it instead (placeholders on rank 0, see :mod:`..checkpoint.streaming`); the
    checkpoint must then be saved with it (:func:`..checkpoint.formats.save`) and nothing else may read it."""
    if fmt == "sharded" and fsdp1_state.supported(model):
        # Each rank's own slices, no all-gather; the entries FSDP does not shard as a local state dict has them.
        return fsdp1_state.model_state_dict(model, _local_state(model, device_type, flat=False))
    if fmt == "full" and fsdp1_state.supports_full(model):
        # Each parameter's pieces sent straight to rank 0, no all-gather on every rank.
        return fsdp1_state.full_model_state_dict(model, _local_state(model, device_type, flat=False), stream)
    if fmt == "local":
        return _local_state(model, device_type, flat=True)
    with state_dict_context(model, fmt, device_type):
        return model.state_dict()


def _local_state(model: Module, device_type: str, *, flat: bool) -> dict[str, Any]:
    """The local state dict: each rank's flat-parameter shard (with ``flat``) and every entry FSDP does not manage
    (buffers, ignored parameters). Tensors are moved to the CPU, not copied there: a synchronous save writes them
    before training goes on, an asynchronous one stages them into its own buffers first."""
    state = _local_state_without_hooks(model, flat=flat)
    if state is None:
        with state_dict_context(model, "local", device_type):
            state = model.state_dict()
    managed = _managed_names(model)
    local: dict[str, Any] = {}
    for key, value in state.items():
        if key.endswith(FLAT_PARAM):
            if flat:
                if isinstance(value, torch.Tensor) and hasattr(value, "local_shards"):  # torch's ShardedTensor
                    shards = value.local_shards()
                    value = shards[0].tensor if shards else torch.empty(0)
                local[key] = value.detach().to("cpu")
        elif key not in managed:
            local[key] = value.detach().to("cpu")
    return local


def _local_state_without_hooks(model: Module, *, flat: bool = True) -> dict[str, Any] | None:
    """``model.state_dict()`` under FSDP's local state-dict type, read from the modules themselves (each module's
    own ``_save_to_state_dict``, so persistent buffers, extra state and overrides are as ``state_dict`` has them), and
    with each unit's flat-parameter shard as a plain tensor. FSDP's hook would wrap every shard in a ``ShardedTensor``,
    one ``all_gather_object`` per unit, which a save only unwraps again: on two CPU ranks that was about a third of
    the time an asynchronous local save blocked training. ``None`` when a module carries state-dict hooks other
    than FSDP's and the checkpoint wrapper's (the caller then asks ``state_dict()``). Without ``flat``, the entries
    other than the flat-parameter shards only (a unit that does not shard has them too)."""
    if not _without_foreign_hooks(model):
        return None
    state: dict[str, Any] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        own = torch_internals.own_state(module, f"{name}." if name else "")
        state.update((clean_name(key), value) for key, value in own.items() if not key.endswith(FLAT_PARAM))
        unit = fsdp1_internals.view(module, name) if flat else None
        if unit is not None:
            if not unit.uses_sharded_strategy:
                return None  # torch's own path raises its error for a local state dict without sharding
            valid = unit.flat_param.numel() - unit.shard_padding  # the shard without FSDP's padding
            state[join_name(unit.name, FLAT_PARAM)] = unit.flat_param.detach()[:valid] if valid > 0 else torch.empty(0)
    return state


def _without_foreign_hooks(model: Module) -> bool:
    """Whether no module of ``model`` carries state-dict hooks other than FSDP's and the checkpoint wrapper's."""
    own_hooks = (fsdp1_internals.STATE_DICT_HOOK_MODULE, torch_internals.CHECKPOINT_WRAPPER_MODULE)
    return all(
        owner in own_hooks for module in model.modules() for owner in torch_internals.state_dict_hook_modules(module)
    )


def _loads_fast(model: Module) -> bool:
    """Whether a sharded load builds its template (see :func:`current_state`) and fills it itself
    (:mod:`..checkpoint.fast_load`): where the package saves sharded state (:func:`.fsdp1_state.supported`), and where
    its pieces fit the units (:func:`.fsdp1_state.loadable`, NO_SHARD) and the entries FSDP does not manage can be read
    without torch's local state dict (which refuses NO_SHARD)."""
    return fsdp1_state.supported(model) or (fsdp1_state.loadable(model) and _without_foreign_hooks(model))


def optimizer_state_dict(
    model: Module,
    optimizer: Optimizer,
    fmt: CheckpointFormat,
    device_type: str,
    rank: int,
    stream: FullStream | None = None,
) -> dict[str, Any]:
    """The optimizer's state in ``fmt``; ``stream``: as for :func:`model_state_dict`."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    if fmt == "local":
        return optimizer.state_dict()
    if fmt == "sharded" and fsdp1_state.supported(model):
        state = fsdp1_state.optimizer_state_dict(model, optimizer)
        if state is not None:
            return state
    if fmt == "full" and fsdp1_state.supports_full(model):
        state = fsdp1_state.full_optimizer_state_dict(model, optimizer, stream)
        if state is not None:
            return state
    with state_dict_context(model, fmt, device_type):
        state = FSDP.optim_state_dict(model, optimizer)
        if fmt == "full" and rank == 0 and fsdp1_internals.uses_orig_params(model):
            # torch's standard per-parameter-id form; with use_orig_params=False the parameters a plain optimizer
            # would see do not exist, so the state stays keyed by parameter name (both forms load here).
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model)
    return state


def local_layout(model: Module) -> dict[str, Any]:
    """What a local checkpoint records of the model: the wrap and each unit's flat-parameter layout."""
    return {"fsdp_units": fsdp_units(model), "flat_params": flat_param_layout(model)}


# ------------------------------------------------------------------------------------------------------ checking
def check_local_layout(path: Path, meta: dict[str, Any], model: Module) -> None:
    current = flat_param_layout(model)
    saved_units = [(e["key"], e["fqns"], e["shapes"]) for e in meta.get("flat_params", [])]
    if saved_units != [(e["key"], e["fqns"], e["shapes"]) for e in current]:
        raise CheckpointError(
            path,
            "its FSDP wrap layout differs from this model's (another model, auto_wrap_policy or use_orig_params); "
            f"saved units {meta.get('fsdp_units')} vs current {fsdp_units(model)}",
        )


def current_state(model: Module, fmt: CheckpointFormat, device_type: str) -> dict[str, Any]:
    """The model's sharded or local state dict, to check a checkpoint against (runs collectives)."""
    if fmt == "sharded" and _loads_fast(model):
        # views of this rank's own slices (see checkpoint.fast_load), built without collectives; torch's all-gathers
        return fsdp1_state.model_state_dict(model, _local_state(model, device_type, flat=False))
    with state_dict_context(model, fmt, device_type):
        return model.state_dict()


def local_shard_keys(current: dict[str, Any]) -> list[str]:
    """The keys a rank's local shard must hold: the flat parameters."""
    return [k for k in current if k.endswith(FLAT_PARAM)]


def expected_full_shapes(model: Module) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters a full state dict of ``model`` must hold."""
    shapes = {
        (f"{e['prefix']}.{f}" if e["prefix"] else f): tuple(s)
        for e in flat_param_layout(model)
        for f, s in zip(e["fqns"], e["shapes"], strict=True)
    }
    for name, param in model.named_parameters():
        clean = clean_name(name)
        if not fsdp1_internals.is_flat_parameter(param) and clean not in shapes:
            shapes[clean] = tuple(param.shape)
    return shapes


# ------------------------------------------------------------------------------------------------------- loading
def fast_load_params(model: Module) -> fast_load.Params | None:
    """For :mod:`..checkpoint.fast_load`: each parameter the optimizers see (an original parameter with
    ``use_orig_params``, else a unit's flat parameter) -> the names it stands for and what builds its state; ``None``
    where the package does not fill this model's sharded state itself (:func:`_loads_fast`)."""
    if not _loads_fast(model):
        return None
    params: fast_load.Params = {}
    for unit in fsdp1_state.units(model):
        if unit.orig_params:
            for param, orig in zip(unit.params, unit.orig_params, strict=True):
                params[id(orig)] = ([param.fqn], _OrigParamState(param))
        else:
            params[id(unit.flat_param)] = ([p.fqn for p in unit.params], _FlatParamState(unit))
    return params


class _OrigParamState:
    """With ``use_orig_params``: an original parameter's state holds this rank's elements of it, flat (NO_SHARD: the
    whole parameter, in its shape); each box of them is a piece."""

    def __init__(self, param: Any) -> None:
        self.param = param

    def read_state(
        self, prefixes: list[str], entries: list[Mapping[str, Any]], pieces: fast_load.Pieces
    ) -> dict[str, torch.Tensor] | None:
        import torch.distributed as dist

        param = self.param
        if param.numel_in_shard == 0:
            return {}  # no element here: FSDP leaves such a parameter without state on this rank, as torch's path does

        def allocate(dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[tuple[int, ...], torch.Tensor]]]:
            tensor = torch.empty(param.state_shape, dtype=dtype)
            boxes = fsdp1_state.local_pieces(param, tensor.view(-1), dist.get_rank())
            return tensor, [(tuple(box.offsets), view) for box, view in boxes]

        return fast_load.param_state(prefixes[0], entries[0], param.shape, pieces, allocate)


class _FlatParamState:
    """Without ``use_orig_params`` the optimizer sees the flat parameter, whose state tensors are this rank's whole
    (padded) flat shard; each original parameter's pieces are views of its elements there. Padding stays zero, as it
    is in training (its gradient is zero). A 0-dim entry (``step``) is the same for every parameter of the unit: the
    first one's is read."""

    def __init__(self, unit: Any) -> None:
        self.unit = unit

    def read_state(
        self, prefixes: list[str], entries: list[Mapping[str, Any]], pieces: fast_load.Pieces
    ) -> dict[str, torch.Tensor] | None:
        import torch.distributed as dist

        leaves = {leaf: md for e in entries for leaf, md in e.items()}
        if any(set(e) != set(leaves) for e in entries):
            return None
        state: dict[str, torch.Tensor] = {}
        rank = dist.get_rank()
        for leaf, md in leaves.items():
            if tuple(md.size) == ():
                state[leaf] = fast_load.scalar_state(f"{prefixes[0]}.{leaf}", md, pieces)
                continue
            flat = torch.zeros(self.unit.local.numel(), dtype=md.properties.dtype)
            for param, prefix, entry in zip(self.unit.params, prefixes, entries, strict=True):
                if tuple(entry[leaf].size) != param.shape:
                    return None
                piece = flat[param.offset_in_shard : param.offset_in_shard + param.numel_in_shard]
                pieces[f"{prefix}.{leaf}"] = [
                    (tuple(b.offsets), v) for b, v in fsdp1_state.local_pieces(param, piece, rank)
                ]
            state[leaf] = flat
        return state


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
    if pending.fmt == "full":
        with state_dict_context(model, "full", device_type, rank0_only=False):
            model.load_state_dict(pending.model_state, strict=strict)
        if load_optimizers and pending.optimizer_states is not None:
            loading.check_optimizer_count(path, pending.optimizer_states, optimizers)
            load_full_optimizers(model, optimizers, pending.optimizer_states, device_type)
    elif pending.fmt == "sharded":
        _load_sharded(pending, model, optimizers, device_type, strict, load_optimizers)
    else:
        _load_local(pending, model, device_type)
        if load_optimizers and pending.optimizer_states is not None:
            loading.check_optimizer_count(path, pending.optimizer_states, optimizers)
            for optimizer, state in zip(optimizers, pending.optimizer_states, strict=True):
                optimizer.load_state_dict(state)


def load_full_optimizers(
    model: Module, optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]], device_type: str
) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    for optimizer, state in zip(optimizers, states, strict=True):
        if not state.get("state"):
            # Nothing to shard (e.g. SGD without momentum): the hyper-parameters are all there is.
            optimizer.load_state_dict({"state": {}, "param_groups": merge_groups(optimizer, state)})
            continue
        if isinstance(next(iter(state["state"])), int):
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, model)
        with state_dict_context(model, "full", device_type, rank0_only=False):
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state))


def _load_sharded(
    pending: loading.PendingLoad,
    model: Module,
    optimizers: Sequence[Optimizer],
    device_type: str,
    strict: bool,
    load_optimizers: bool,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    path = pending.path
    if loading.load_sharded_fast(pending, model, optimizers, strict, load_optimizers, fast_load_params):
        return
    if _loads_fast(model):  # the template check_load built is the package's: torch's path needs its own
        with state_dict_context(model, "sharded", device_type):
            pending.model_state = model.state_dict()
    with state_dict_context(model, "sharded", device_type):
        model_key = dcp_model_key(pending.rest)
        state = {model_key: pending.model_state}
        dcp.load(state, storage_reader=storage_reader(path, weights_only=pending.weights_only))
        model.load_state_dict(state[model_key], strict=strict)
        if not load_optimizers:
            return
        reader = storage_reader(path, weights_only=pending.weights_only)

        def load_one(key: str, optimizer: Optimizer) -> None:
            loaded = load_sharded_optimizer_state_dict(state[model_key], key, reader)[key]
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, loaded))

        loading.for_each_sharded_optimizer(pending, optimizers, load_one)


def _load_local(pending: loading.PendingLoad, model: Module, device_type: str) -> None:
    copies = _local_copies(pending.model_state, model)
    if copies is not None:
        with torch.no_grad():
            for target, value in copies:
                target.copy_(value)
        return
    with state_dict_context(model, "local", device_type), torch.no_grad():
        current = model.state_dict()
        for key, value in pending.model_state.items():
            if key.endswith(FLAT_PARAM):
                local_shards = current[key].local_shards()
                if local_shards:
                    local_shards[0].tensor.copy_(value)
            else:
                current[key] = value
        model.load_state_dict(current, strict=False)


def _local_copies(saved: dict[str, Any], model: Module) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """A local checkpoint's entries paired with the tensors they are copied into: each unit's flat-parameter shard
    (without FSDP's padding, as :func:`_local_state` saves it and torch's local state dict holds it) and each buffer or
    unmanaged parameter of the model. Torch's local ``load_state_dict`` builds a ``ShardedTensor`` per unit (an
    ``all_gather_object`` each) to copy the same bytes: more than half of an 80-layer FSDP1 local resume. ``None``
    (the caller takes torch's path) for an entry that is not one of these tensors or has another number of
    elements."""
    units = {join_name(unit.name, FLAT_PARAM): unit for unit in fsdp1_internals.units(model)}
    own = {clean_name(n): t for n, t in (*model.named_parameters(), *model.named_buffers())}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key, value in saved.items():
        unit = units.get(key)
        if not isinstance(value, torch.Tensor):
            return None
        if unit is not None:
            if not unit.uses_sharded_strategy:
                return None
            valid = max(unit.local_shard.numel() - unit.shard_padding, 0)
            if value.numel() != valid:
                return None
            if valid:
                copies.append((unit.local_shard.detach()[:valid], value.reshape(-1)))
        elif key in own and not fsdp1_internals.is_flat_parameter(own[key]) and own[key].shape == value.shape:
            copies.append((own[key].detach(), value))
        else:
            return None
    return copies
