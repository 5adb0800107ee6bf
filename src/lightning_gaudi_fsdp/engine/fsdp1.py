"""The FSDP1 engine: ``FullyShardedDataParallel`` wraps the model in a new root, each unit flattening its parameters
into one flat parameter of which every rank holds a contiguous slice (state dicts: :mod:`.fsdp1_state`; the flat
parameters' layout: :mod:`..adapters.fsdp1_internals`)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.nn import Module

from lightning_gaudi_fsdp import _activation_checkpointing as activation
from lightning_gaudi_fsdp import _sharding, options
from lightning_gaudi_fsdp.adapters import fsdp1_internals, lightning_internals, torch_internals
from lightning_gaudi_fsdp.checkpoint import pretrained
from lightning_gaudi_fsdp.engine import fsdp1_io, fsdp1_state


class FSDP1:
    version = 1
    label = "FSDP1 (FullyShardedDataParallel)"
    held_label = "flat parameters per rank"

    def owns(self, model: Module) -> bool:
        return any(isinstance(m, fsdp1_internals.fsdp_class()) for m in model.modules())

    def held_tensors(self, model: Module) -> list[Any]:
        return list(fsdp1_internals.flat_params(model))

    def check_arguments(self, *, sharding_strategy: Any, state_dict_type: str, device_mesh: Any, **_: Any) -> None:
        options.check_state_dict_type(state_dict_type, sharding_strategy, device_mesh)

    def mixed_precision_config(self, mixed_precision: Any) -> Any:
        return options.resolve_mixed_precision(mixed_precision)

    def mixed_precision_policy(self, mixed_precision: Any) -> None:
        return None

    def default_mesh(self, mesh: Any, sharding_strategy: Any, device_type: str, *sizes: int) -> Any:
        return mesh  # FSDP1 makes its own groups without one

    def shard(self, door: Any, model: Module) -> Module:
        return wrap(door, model)

    def adopt_wrapped(self, door: Any, model: Module, lightning_setup: Callable[[Module], Module]) -> Module:
        """A model whose FSDP units the user wrapped by hand (``wrap()`` in ``configure_model`` or under
        ``fabric.init_module()``), on either door. Units below a plain root: the root is wrapped too (what FSDP's docs
        require; Lightning leaves it out, so the parameters outside the user's units stayed plain, and each rank
        trained its own copy of them). A root wrapped by hand: Lightning's own setup (``lightning_setup``, which also
        applies activation checkpointing), then the KV cache of checkpointed ``transformers`` models off in
        training, as for a model the strategy wraps, and the batch dtypes kept at the root."""
        _sharding.refuse_pretrained_when_wrapped(door)
        if not isinstance(model, fsdp1_internals.fsdp_class()):
            return wrap(door, model)
        model = lightning_setup(model)
        if door._config.activation_checkpointing_kwargs:
            door._cache_off_in_training = activation.apply_cache_off_in_training(model)
        if isinstance(model, fsdp1_internals.fsdp_class()):
            _sharding.keep_batch_dtypes(door, model)
        return model

    def wrap_context(self, door: Any) -> AbstractContextManager:
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(**wrap_context_kwargs(door))

    def set_up(self, door: Any, model: Module, lightning_setup: Callable[[Module], Module]) -> Module:
        previous = door._fsdp_root
        if previous is not None and previous.module is model:
            # trainer.validate/test/predict after fit hand back the bare LightningModule, whose FSDP children still
            # hold their shards; re-wrapping it would treat the root's sharded views as full parameters.
            return previous
        if self.owns(model):
            return self.adopt_wrapped(door, model, lightning_setup)
        return wrap(door, model)

    def step(
        self,
        door: Any,
        name: str,
        context: Callable[[], AbstractContextManager],
        lightning_step: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        module, root = door.lightning_module, door._fsdp_root
        if name != "training_step" or module is None or module.automatic_optimization or root is None:
            return lightning_step(*args, **kwargs)  # Lightning runs the step inside the wrapper's forward
        # Manual optimization: Lightning would run the whole training_step inside the root's forward, where FSDP
        # cannot run manual_backward. Run it outside, and send the module's own forward (``self(x)``) through the
        # root, as Fabric users call their wrapped model.
        with context(), forward_through_root(root, module):
            return module.training_step(*args, **kwargs)

    def refuse_optimizers_made_before(self, optimizers: list[Any]) -> None:
        return None  # the wrapper keeps the module's parameters (use_orig_params) or Lightning refuses them

    def clip_grad_norm(self, root: Module, max_norm: float, norm_type: float) -> torch.Tensor:
        return root.clip_grad_norm_(max_norm, norm_type)  # type: ignore[operator]

    def no_sync(self, module: Module) -> AbstractContextManager:
        if not isinstance(module, fsdp1_internals.fsdp_class()):
            raise _sharding.not_set_up_for_no_sync(module)
        return module.no_sync()

    def mixed_precision_row(self, door: Any) -> str:
        mp = door.mixed_precision_config  # see wrap
        if mp is None:
            return "fp32 (no FSDP mixed precision)"
        return f"param={mp.param_dtype}, reduce={mp.reduce_dtype}, buffer={mp.buffer_dtype}"

    def fingerprint(self, model: Module) -> dict[str, int]:
        return fsdp1_internals.unit_sizes(model)

    def held_elements(self, model: Module) -> int:
        return sum(p.numel() for p in fsdp1_state.flat_params(model))

    def unit_count(self, model: Module) -> int:
        return sum(isinstance(m, fsdp1_internals.fsdp_class()) for m in model.modules())

    def load_pretrained(self, model: Module, prepared: Any, device: torch.device) -> int:
        return pretrained.load(model, prepared, device)

    # checkpoints, per format (:mod:`.fsdp1_io`)
    model_state_dict = staticmethod(fsdp1_io.model_state_dict)
    optimizer_state_dict = staticmethod(fsdp1_io.optimizer_state_dict)
    local_layout = staticmethod(fsdp1_io.local_layout)
    check_local_layout = staticmethod(fsdp1_io.check_local_layout)
    current_state = staticmethod(fsdp1_io.current_state)
    local_shard_keys = staticmethod(fsdp1_io.local_shard_keys)
    expected_full_shapes = staticmethod(fsdp1_io.expected_full_shapes)
    apply_load = staticmethod(fsdp1_io.apply_load)

    def load_full_optimizer(self, model: Module, optimizer: Any, state: dict[str, Any], device_type: str) -> None:
        fsdp1_io.load_full_optimizers(model, [optimizer], [state], device_type)


def wrap(door: Any, model: Module) -> Module:
    """Wrap ``model`` (no FSDP unit inside yet) in ``FullyShardedDataParallel`` with the strategy's arguments, apply
    activation checkpointing and keep the batch dtypes when asked; records the root on ``door``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    kwargs = fsdp_arguments(door._config)
    if kwargs.get("auto_wrap_policy") is not None and any(isinstance(m, FSDP) for m in model.modules()):
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            "auto_wrap_policy is ignored: the model holds FSDP units wrapped by hand (wrap()); the parameters outside "
            "them go into the root unit"
        )
        del kwargs["auto_wrap_policy"]
    prepared = _sharding.plan_pretrained(door, model)
    if prepared is not None:
        kwargs["param_init_fn"] = pretrained.empty_init(_sharding.fsdp_device(door))
    if kwargs.get("sync_module_states") and _sharding.fsdp_device(door).type == "cpu":
        # torch refuses sync_module_states for CPU tensors although gloo broadcasts them fine.
        _sharding.broadcast_module_states(model)
        kwargs["sync_module_states"] = False
    try:
        model = FSDP(
            module=model,
            cpu_offload=_sharding.effective_cpu_offload(door),
            # Lightning's mixed_precision_config: the mixed_precision argument, else what the precision plugin
            # (Trainer/Fabric precision="bf16-mixed"...) asks of FSDP1; the plugin is set after construction.
            mixed_precision=door.mixed_precision_config,
            sharding_strategy=door._config.sharding_strategy,
            device_id=_sharding.fsdp_device(door),
            **_sharding.resolve_ignored(door, model),
            **kwargs,
        )
    except ValueError as err:
        unit = fsdp1_internals.mixed_requires_grad_unit(err)
        if unit is None:
            raise
        raise ValueError(_mixed_requires_grad_message(unit)) from err
    lightning_internals.move_torchmetrics_to_device(model, door.root_device)
    _sharding.load_pretrained(door, model, prepared)
    _sharding.average_replicated_gradients(model, door.world_size)
    door._cache_off_in_training = activation.apply_activation_checkpointing(
        model, door._config.activation_checkpointing_kwargs
    )
    _sharding.keep_batch_dtypes(door, model)
    return model


def fsdp_arguments(config: Any) -> dict[str, Any]:
    """The ``FullyShardedDataParallel`` keyword arguments every unit takes from the resolved options (beside the
    device, offload, mixed precision, sharding strategy and ignored modules, which :func:`wrap` decides)."""
    arguments: dict[str, Any] = {
        "backward_prefetch": config.backward_prefetch,
        "param_init_fn": config.param_init_fn,
        "sync_module_states": config.sync_module_states,
        "forward_prefetch": config.forward_prefetch,
        "limit_all_gathers": config.limit_all_gathers,
        "use_orig_params": config.use_orig_params,
    }
    if config.process_group is not None:
        arguments["process_group"] = config.process_group
    if config.auto_wrap_policy is not None:
        arguments["auto_wrap_policy"] = config.auto_wrap_policy
    if config.device_mesh is not None:
        arguments["device_mesh"] = config.device_mesh
    return arguments


def _mixed_requires_grad_message(unit: str) -> str:
    return (
        f"use_orig_params=False cannot shard {unit!r}: one FSDP unit mixes frozen (requires_grad=False) and trainable "
        "parameters, as PEFT/LoRA adapters over a frozen base do, and FSDP1 then needs the original parameters; "
        "pass use_orig_params=True (the default)"
    )


def wrap_context_kwargs(door: Any) -> dict[str, Any]:
    """The arguments of ``enable_wrap`` for ``wrap()`` calls while the model is built: those of automatic wrapping,
    with a device."""
    kwargs = {k: v for k, v in fsdp_arguments(door._config).items() if k != "auto_wrap_policy"}
    return {
        "wrapper_cls": _wrap_unit,
        "cpu_offload": _sharding.effective_cpu_offload(door, warn=False),
        "mixed_precision": door.mixed_precision_config,  # see wrap
        "sharding_strategy": door._config.sharding_strategy,
        "device_id": _sharding.fsdp_device(door),
        **kwargs,
    }


def _wrap_unit(module: Module, **kwargs: Any) -> Module:
    """What ``wrap(module)`` does under ``fsdp_version=1``: ``FullyShardedDataParallel(module, **kwargs)``, with
    ``sync_module_states`` done by a broadcast on CPU (as :func:`wrap` does: torch refuses it for CPU tensors)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kwargs.get("sync_module_states") and torch.device(kwargs["device_id"]).type == "cpu":
        _sharding.broadcast_module_states(module)
        kwargs["sync_module_states"] = False
    return FSDP(module, **kwargs)


@contextmanager
def forward_through_root(root: Module, module: Module) -> Generator[None, None, None]:
    """While active, ``module(...)`` and ``module.forward(...)`` run as the FSDP ``root``'s forward (which calls back
    into the module's real forward). An FSDP unit called directly, outside that forward and outside backward
    recomputation, raises a clear error instead of FSDP's state assertion later in backward."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    original_forward = module.forward
    patched_before = "forward" in vars(module)  # e.g. by another wrapper: put back exactly what was there
    inside = False

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside
        if inside:  # the root calling into the module
            return original_forward(*args, **kwargs)
        inside = True
        try:
            return root(*args, **kwargs)
        finally:
            inside = False

    def guard(unit: Module, args: Any) -> None:
        if not inside and not torch_internals.in_backward():
            raise RuntimeError(
                "With manual optimization under GaudiFSDPStrategy, call the model as self(...) (the LightningModule's "
                f"forward) in training_step: the FSDP unit {type(unit.module).__name__} was called directly, "
                "outside the FSDP root's forward, which FSDP cannot run backward for"
            )

    hooks = [
        unit.register_forward_pre_hook(guard) for unit in root.modules() if isinstance(unit, FSDP) and unit is not root
    ]
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if patched_before:
            module.forward = original_forward  # type: ignore[method-assign]
        else:
            del module.forward
        for hook in hooks:
            hook.remove()
