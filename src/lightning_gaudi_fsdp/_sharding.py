"""Sharding a module with either engine, with the door's resolved arguments: FSDP1 wrapping, FSDP2's
``fully_shard``, pretrained weights into the shards, compile, gradient clipping (the door: see :mod:`._platform`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module

from lightning_gaudi_fsdp import _report, gaudi, module_options
from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.checkpoint import integrity, loading, pretrained
from lightning_gaudi_fsdp.engine.pieces import carries_host_tensors, gather_objects

log = logging.getLogger("lightning_gaudi_fsdp")


def fsdp_device(door: Any) -> torch.device:
    device_id = door._config.device_id
    if device_id is None:
        return door.root_device
    if isinstance(device_id, int):
        return torch.device(door.root_device.type, device_id)
    device = torch.device(device_id)
    if device.index is None and device.type == door.root_device.type:
        return door.root_device  # "hpu": this rank's own device, with its index
    return device


def effective_cpu_offload(door: Any, warn: bool = True) -> CPUOffload:
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    if door._config.cpu_offload.offload_params and fsdp_device(door).type == "cpu":
        # FSDP pins offloaded shards, which needs an accelerator; on a CPU run they already live in CPU memory.
        if warn:
            rank_zero_warn("cpu_offload=True has no effect when the model already runs on the CPU; it is ignored.")
        return CPUOffload(offload_params=False)
    return door._config.cpu_offload


def warn_if_precision_overlaps(door: Any) -> None:
    """Warn (Trainer door) that ``mixed_precision`` overrides the dtypes the Trainer's precision would choose (either
    engine: FSDP1's ``MixedPrecision`` or FSDP2's ``MixedPrecisionPolicy``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    plugin_precision = door.precision_plugin.precision
    if door._config.has_mixed_precision and plugin_precision != "32-true":
        rank_zero_warn(
            f"GaudiFSDPStrategy(mixed_precision=...) sets FSDP's parameter/reduce/buffer dtypes and overrides the "
            f"dtypes Trainer(precision={plugin_precision!r}) would choose for them; autocast and input casting "
            "still follow the Trainer's precision."
        )


def refuse_parameter_groups(door: Any, cause: ValueError | None) -> None:
    """Raise when ``door``'s optimizers have several parameter groups that FSDP would flatten together
    (``use_orig_params=False``); ``cause``: Lightning's own refusal, chained."""
    if door._config.use_orig_params:
        return
    groups = max((len(optimizer.param_groups) for optimizer in door.optimizers), default=0)
    if groups > 1:
        raise ValueError(
            f"configure_optimizers returned {groups} parameter groups, which needs use_orig_params=True "
            "(with use_orig_params=False FSDP flattens each unit into one parameter and the groups cannot be "
            "kept apart)"
        ) from cause


def resolve_ignored(door: Any, module: Module) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if door._config.ignored_modules is not None:
        kwargs["ignored_modules"] = module_options.resolve_submodules(
            module, door._config.ignored_modules, "ignored_modules"
        )
    if door._config.ignored_states is not None:
        kwargs["ignored_states"] = module_options.resolve_submodules(
            module, door._config.ignored_states, "ignored_states", allow_parameters=True
        )
    return kwargs


def init_context(door: Any) -> AbstractContextManager:
    """Around the model's construction (``configure_model``, ``fabric.init_module()``): with ``pretrained_weights``,
    parameters are created on the meta device (the shards get the file's values after wrapping)."""
    return pretrained.parameters_on_meta() if door._config.pretrained is not None else nullcontext()


def refuse_pretrained_when_wrapped(door: Any) -> None:
    """For a model whose FSDP units the user wrapped by hand: ``pretrained_weights`` cannot be loaded into it."""
    if door._config.pretrained is not None:
        raise ValueError(
            "pretrained_weights needs the model unwrapped when the strategy sets it up: build it without wrap() "
            "and let auto_wrap_policy choose the FSDP units"
        )


def plan_pretrained(door: Any, model: Module) -> pretrained.Plan | None:
    """Before wrapping: verify a checkpoint's checksums (every rank a part; any damage raises on every rank), then
    match the model's parameters to ``pretrained_weights`` (every rank finds the same problems, so every rank raises
    them before any collective); adapters draw from rank 0's seed."""
    if door._config.pretrained is None:
        return None
    weights = door._config.pretrained
    if weights.kind == "checkpoint" and door._config.verify_checkpoints:  # one of the package's: its checksums
        verified = loading.agreed(
            weights.path,
            lambda: loading.verify_share(weights.path, door.global_rank, door.world_size),
            door.world_size,
        )
        if not verified:
            from lightning.fabric.utilities.rank_zero import rank_zero_info

            rank_zero_info(integrity.NOT_VERIFIED.format(path=str(weights.path)))
    prepared = pretrained.plan(model, weights)
    prepared.seed = gather_objects(torch.initial_seed(), door.world_size)[0]
    return prepared


def load_pretrained(door: Any, model: Module, prepared: pretrained.Plan | None) -> None:
    """After wrapping: copy the rank's slices of ``pretrained_weights`` into its shards."""
    if prepared is None:
        return
    written = door._engine.load_pretrained(model, prepared, fsdp_device(door))
    log.info(
        "rank %d: %d pretrained elements read from %s into its shards",
        door.global_rank,
        written,
        door._config.pretrained.path,
    )


def keep_batch_dtypes(door: Any, model: Module) -> None:
    door._fsdp_root = model
    if door._config.keep_batch_dtypes:
        # The units below cast their own inputs; the root (the LightningModule) leaves the batch as it is.
        model.mixed_precision = dataclasses.replace(
            model.mixed_precision, cast_forward_inputs=False, cast_root_forward_inputs=False
        )


def compile_root(door: Any, model: Module) -> None:
    """Compile the FSDP root in place (``nn.Module.compile``): the module stays an FSDP instance, so checkpoint
    contexts keep working, and dynamo traces through FSDP's hooks (it needs ``use_orig_params=True``)."""
    kwargs = dict(door._config.compile_kwargs)
    kwargs.setdefault("backend", gaudi.default_compile_backend(door.root_device.type))
    gaudi.prepare_compile_backend(kwargs["backend"])
    model.compile(**kwargs)
    _report.compiled_units([""])


def unsharded_tensors(module: Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``module`` no unit shards: not a DTensor (FSDP2), not an FSDP1 flat parameter
    or one of its original parameters. Before wrapping that is all of them; after, the buffers and what
    ``ignored_modules``/``ignored_states`` leave out, replicated on every rank."""
    from torch.distributed.tensor import DTensor

    from lightning_gaudi_fsdp.adapters import fsdp1_internals

    sharded: set[int] = set()
    for unit in fsdp1_internals.units(module):
        sharded.add(id(unit.flat_param))
        sharded.update(id(p) for p in unit.orig_params)
    return [t for t in (*module.parameters(), *module.buffers()) if id(t) not in sharded and not isinstance(t, DTensor)]


def average_replicated_gradients(model: Module, world_size: int) -> None:
    """Average the gradients of the trainable parameters of the sharded ``model`` that no unit manages
    (``ignored_modules``/``ignored_states``) over every rank as each backward accumulates them, as DDP would: FSDP
    reduces only what it shards, and these would otherwise train on each rank's own data and drift apart. A sum
    divided by the world size (HCCL has no AVG); averaging an accumulated gradient again keeps it exact under
    gradient accumulation. Called once the parameters are final (materialised, pretrained weights loaded)."""
    if world_size < 2 or not torch.distributed.is_initialized():
        return
    for param in unsharded_tensors(model):
        if not isinstance(param, torch.nn.Parameter):
            continue  # a buffer
        if param.requires_grad and not getattr(param, "_gaudi_fsdp_grad_averaged", False):
            param.register_post_accumulate_grad_hook(functools.partial(_average_gradient, world_size=world_size))
            param._gaudi_fsdp_grad_averaged = True


def _average_gradient(param: torch.Tensor, world_size: int) -> None:
    if param.grad is not None:
        torch.distributed.all_reduce(param.grad, op=torch.distributed.ReduceOp.SUM)
        param.grad.div_(world_size)


def broadcast_module_states(module: Module) -> None:
    """Copy rank 0's parameters and buffers, still on the host, to every rank (what ``sync_module_states`` does on
    accelerators): over the default group where its backend takes CPU tensors (gloo), else over a gloo group made for
    it (Gaudi's hccl takes ``hpu`` tensors only). Those already sharded by units wrapped by hand were copied before
    they were sharded."""
    states = unsharded_tensors(module)
    if any(t.is_meta for t in states):
        raise ValueError(
            "sync_module_states=True on CPU needs a materialised model, but it has meta-device tensors; "
            "use param_init_fn (or reset_parameters) with the same seed on every rank instead"
        )
    if not torch.distributed.is_initialized():
        return
    # The model is still on the host; Intel's hccl carries hpu tensors only: broadcast over a gloo group there.
    group = None if carries_host_tensors() else torch_internals.new_host_group()
    try:
        with torch.no_grad():
            for tensor in states:
                torch.distributed.broadcast(tensor.data, src=0, group=group)
    finally:
        if group is not None:
            torch.distributed.destroy_process_group(group)


def clip_grad_norm(engine: Any, root: Module | None, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the norm over every shard on every rank (``clip_grad_norm_`` on one shard sees only its share)."""
    if root is None:
        raise RuntimeError("gradient clipping by norm needs the FSDP-wrapped model; the strategy is not set up")
    return engine.clip_grad_norm(root, max_norm, norm_type)


def not_set_up_for_no_sync(module: Module) -> TypeError:
    return TypeError(
        f"no_backward_sync needs the model set up by Fabric with GaudiFSDPStrategy, got {type(module).__name__}"
    )
