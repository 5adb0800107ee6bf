"""Sharding a module with either engine, with the door's resolved arguments: FSDP1 wrapping, FSDP2's
``fully_shard``, pretrained weights into the shards, compile, gradient clipping (the door: see :mod:`._platform`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.nn import Module, Parameter

from lightning_gaudi_fsdp import _activation_checkpointing as activation
from lightning_gaudi_fsdp import _report, gaudi, options
from lightning_gaudi_fsdp._platform import gather_objects
from lightning_gaudi_fsdp.adapters import fsdp1_internals, lightning_internals
from lightning_gaudi_fsdp.checkpoint import pretrained

log = logging.getLogger("lightning_gaudi_fsdp")


def fsdp_device(door: Any) -> torch.device:
    device_id = door._device_id
    if device_id is None:
        return door.root_device
    if isinstance(device_id, int):
        return torch.device(door.root_device.type, device_id)
    return torch.device(device_id)


def effective_cpu_offload(door: Any, warn: bool = True) -> CPUOffload:
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    if door.cpu_offload.offload_params and fsdp_device(door).type == "cpu":
        # FSDP pins offloaded shards, which needs an accelerator; on a CPU run they already live in CPU memory.
        if warn:
            rank_zero_warn("cpu_offload=True has no effect when the model already runs on the CPU; it is ignored.")
        return CPUOffload(offload_params=False)
    return door.cpu_offload


def resolve_ignored(door: Any, module: Module) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if door._ignored_modules is not None:
        kwargs["ignored_modules"] = options.resolve_submodules(module, door._ignored_modules, "ignored_modules")
    if door._ignored_states is not None:
        kwargs["ignored_states"] = options.resolve_submodules(
            module, door._ignored_states, "ignored_states", allow_parameters=True
        )
    return kwargs


def wrap_fsdp1(door: Any, model: Module) -> Module:
    """Wrap ``model`` (no FSDP unit inside yet) in ``FullyShardedDataParallel`` with the strategy's arguments, apply
    activation checkpointing and keep the batch dtypes when asked; records the root on ``door``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    kwargs = dict(door.kwargs)
    prepared = plan_pretrained(door, model)
    if prepared is not None:
        kwargs["param_init_fn"] = pretrained.empty_init(fsdp_device(door))
    if kwargs.get("sync_module_states") and fsdp_device(door).type == "cpu":
        # torch refuses sync_module_states for CPU tensors although gloo broadcasts them fine.
        broadcast_module_states(model)
        kwargs["sync_module_states"] = False
    try:
        model = FSDP(
            module=model,
            cpu_offload=effective_cpu_offload(door),
            mixed_precision=door.mixed_precision_config,
            sharding_strategy=door.sharding_strategy,
            device_id=fsdp_device(door),
            **resolve_ignored(door, model),
            **kwargs,
        )
    except ValueError as err:
        unit = fsdp1_internals.mixed_requires_grad_unit(err)
        if unit is None:
            raise
        raise ValueError(_mixed_requires_grad_message(unit)) from err
    lightning_internals.move_torchmetrics_to_device(model, door.root_device)
    load_pretrained(door, model, prepared)
    door._cache_off_in_training = activation.apply_activation_checkpointing(
        model, door._activation_checkpointing_kwargs
    )
    keep_batch_dtypes(door, model)
    return model


def _mixed_requires_grad_message(unit: str) -> str:
    return (
        f"use_orig_params=False cannot shard {unit!r}: one FSDP unit mixes frozen (requires_grad=False) and trainable "
        "parameters, as PEFT/LoRA adapters over a frozen base do, and FSDP1 then needs the original parameters; "
        "pass use_orig_params=True (the default)"
    )


def init_context(door: Any) -> AbstractContextManager:
    """Around the model's construction (``configure_model``, ``fabric.init_module()``): with ``pretrained_weights``,
    parameters are created on the meta device (the shards get the file's values after wrapping)."""
    return pretrained.parameters_on_meta() if door._pretrained is not None else nullcontext()


def plan_pretrained(door: Any, model: Module) -> pretrained.Plan | None:
    """Before wrapping: match the model's parameters to ``pretrained_weights`` (every rank finds the same problems,
    so every rank raises them before any collective); adapters draw from rank 0's seed."""
    if door._pretrained is None:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if any(isinstance(m, FSDP) for m in model.modules()):
        raise ValueError(
            "pretrained_weights needs the model unwrapped when the strategy sets it up: build it without wrap() "
            "and let auto_wrap_policy choose the FSDP units"
        )
    prepared = pretrained.plan(model, door._pretrained)
    prepared.seed = gather_objects(torch.initial_seed(), door.world_size)[0]
    return prepared


def load_pretrained(door: Any, model: Module, prepared: pretrained.Plan | None) -> None:
    """After wrapping: copy the rank's slices of ``pretrained_weights`` into its shards."""
    if prepared is None:
        return
    written = pretrained.load(model, prepared)
    log.info(
        "rank %d: %d pretrained elements read from %s into its shards",
        door.global_rank,
        written,
        door._pretrained.path,
    )


def keep_batch_dtypes(door: Any, model: Module) -> None:
    door._fsdp_root = model
    if door._keep_batch_dtypes:
        # The units below cast their own inputs; the root (the LightningModule) leaves the batch as it is.
        model.mixed_precision = dataclasses.replace(
            model.mixed_precision, cast_forward_inputs=False, cast_root_forward_inputs=False
        )


def wrap_context_kwargs(door: Any) -> dict[str, Any]:
    """The arguments of ``enable_wrap`` for ``wrap()`` calls while the model is built: those of automatic wrapping,
    with a device."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    kwargs = {k: v for k, v in door.kwargs.items() if k != "auto_wrap_policy"}
    return {
        "wrapper_cls": FSDP,
        "cpu_offload": effective_cpu_offload(door, warn=False),
        "mixed_precision": door.mixed_precision_config,
        "sharding_strategy": door.sharding_strategy,
        "device_id": fsdp_device(door),
        **kwargs,
    }


def shard_fsdp2(door: Any, model: Module) -> Module:
    """Shard ``model`` in place with ``fully_shard`` (FSDP2) with the strategy's arguments; records the root."""
    from lightning_gaudi_fsdp.engine import fsdp2

    prepared = plan_pretrained(door, model)
    ignored = resolve_ignored(door, model)
    if door.kwargs.get("sync_module_states"):
        broadcast_module_states(model)
    door._cache_off_in_training = activation.apply_activation_checkpointing(
        model, door._activation_checkpointing_kwargs
    )
    units = fsdp2.select_units(model, door.kwargs.get("auto_wrap_policy"), ignored.get("ignored_modules", ()))
    offload = effective_cpu_offload(door)
    fsdp2.apply_fsdp2(
        model,
        units,
        mesh=fsdp2_mesh(door),
        reshard_after_forward=door.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
        mp_policy=door._mp_policy,
        offload_policy=_offload_policy(offload),
        ignored_params=_ignored_parameters(ignored),
        root_casts_inputs=not door._keep_batch_dtypes,
    )
    init_fn = pretrained.empty_init(fsdp_device(door)) if prepared is not None else door.kwargs.get("param_init_fn")
    fsdp2.materialize_meta(model, fsdp_device(door), init_fn)
    load_pretrained(door, model, prepared)
    if door.kwargs.get("forward_prefetch"):
        fsdp2.set_forward_prefetch(units)
    if door.process_group_backend == "hccl":
        fsdp2.force_sum_reductions(model)
    lightning_internals.move_torchmetrics_to_device(model, door.root_device)
    door._fsdp_root = model
    return model


def fsdp2_mesh(door: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = door._device_mesh
    if isinstance(mesh, DeviceMesh):
        return mesh
    device_type = door.root_device.type
    if door.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, fsdp1_internals.hybrid_zero2()):
        # (replicate, shard): default one replica per node, sharded over the node's devices
        shape = (door.num_nodes, door.num_processes)
        door._device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    else:
        door._device_mesh = init_device_mesh(device_type, (door.world_size,))
    return door._device_mesh


def _offload_policy(offload: CPUOffload) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy() if offload.offload_params else None


def _ignored_parameters(ignored: Mapping[str, Any]) -> set[Parameter] | None:
    """FSDP2's ``ignored_params`` from FSDP1's ``ignored_modules``/``ignored_states`` (modules count with every
    parameter they hold)."""
    items = [*ignored.get("ignored_modules", ()), *ignored.get("ignored_states", ())]
    if not items:
        return None
    params: set[Parameter] = set()
    for item in items:
        params.update(item.parameters() if isinstance(item, Module) else [item])
    return params


def compile_root(door: Any, model: Module) -> None:
    """Compile the FSDP root in place (``nn.Module.compile``): the module stays an FSDP instance, so checkpoint
    contexts keep working, and dynamo traces through FSDP's hooks (it needs ``use_orig_params=True``)."""
    kwargs = dict(door._compile_kwargs)
    kwargs.setdefault("backend", gaudi.default_compile_backend(door.root_device.type))
    gaudi.prepare_compile_backend(kwargs["backend"])
    model.compile(**kwargs)
    _report.compiled_units([""])


def broadcast_module_states(module: Module) -> None:
    """Copy rank 0's parameters and buffers to every rank (what ``sync_module_states`` does on accelerators)."""
    states = [t for t in (*module.parameters(), *module.buffers())]
    if any(t.is_meta for t in states):
        raise ValueError(
            "sync_module_states=True on CPU needs a materialised model, but it has meta-device tensors; "
            "use param_init_fn (or reset_parameters) with the same seed on every rank instead"
        )
    if not torch.distributed.is_initialized():
        return
    with torch.no_grad():
        for tensor in states:
            torch.distributed.broadcast(tensor.data, src=0)


def clip_grad_norm(root: Module | None, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the norm over every shard on every rank (``clip_grad_norm_`` on one shard sees only its share)."""
    if root is None:
        raise RuntimeError("gradient clipping by norm needs the FSDP-wrapped model; the strategy is not set up")
    from lightning_gaudi_fsdp.engine import fsdp2

    if fsdp2.is_fsdp2(root):
        return fsdp2.clip_grad_norm_(root, max_norm, norm_type)  # DTensor gradients: the norm spans every rank
    return root.clip_grad_norm_(max_norm, norm_type)  # type: ignore[operator]
