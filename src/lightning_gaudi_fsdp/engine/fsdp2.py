"""The FSDP2 engine: ``torch.distributed.fsdp.fully_shard`` (one DTensor per parameter, no flat parameters).

The ``apply_*`` functions (:mod:`.fsdp2_apply`) take resolved values (a mesh, a ``MixedPrecisionPolicy``, the units
to shard), torchtitan's ``apply_fsdp`` style; :func:`shard` decides them from the door's resolved options, and
:class:`FSDP2` is the engine object the doors hold (see :mod:`.base`). The LightningModule itself becomes the FSDP2
root, so its own parameters are gathered when its forward runs, and the strategy runs each step through that forward
as it does for FSDP1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.nn import Module, Parameter

from lightning_gaudi_fsdp import _activation_checkpointing as activation
from lightning_gaudi_fsdp import _exit, _sharding, options
from lightning_gaudi_fsdp.adapters import fsdp1_internals, lightning_internals
from lightning_gaudi_fsdp.checkpoint import pretrained
from lightning_gaudi_fsdp.engine import fsdp2_io, fsdp2_state
from lightning_gaudi_fsdp.engine.fsdp2_apply import (
    apply_fsdp2,
    force_sum_reductions,
    materialize_meta,
    post_order,
    select_units,
    set_forward_prefetch,
)
from lightning_gaudi_fsdp.engine.fsdp2_state import is_fsdp2

if TYPE_CHECKING:
    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream


def held_elements(model: Module) -> int:
    """Elements of the parameter shards this rank holds."""
    from torch.distributed.tensor import DTensor

    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


def unit_names(model: Module) -> dict[str, int]:
    """Each FSDP2 module (by name) and the global number of elements of the parameters it manages."""
    from torch.distributed.fsdp import FSDPModule

    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    owned: set[int] = set()
    sizes: dict[str, int] = {}
    for name, module in reversed(units):  # innermost first: a unit owns what no unit below it owns
        params = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        sizes[name] = sum(p.numel() for p in params)
    return dict(reversed(list(sizes.items())))


def clip_grad_norm_(model: Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the global norm over every rank's gradient shards (DTensors reduce across the mesh)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# --------------------------------------------------------------------------------------------------- the engine
class FSDP2:
    version = 2
    label = "FSDP2 (fully_shard)"
    held_label = "parameter shards per rank"

    def owns(self, model: Module) -> bool:
        return is_fsdp2(model)

    def held_tensors(self, model: Module) -> list[Any]:
        return []  # the parameters are the shards

    def check_arguments(self, *, state_dict_type: str, device_mesh: Any, **checked: Any) -> None:
        options.check_fsdp2_arguments(**checked)  # state_dict_type, device_mesh: nothing FSDP2 refuses here

    def mixed_precision_config(self, mixed_precision: Any) -> None:
        return None

    def mixed_precision_policy(self, mixed_precision: Any) -> Any:
        return options.resolve_mixed_precision_policy(mixed_precision)

    def default_mesh(
        self, mesh: Any, sharding_strategy: Any, device_type: str, num_nodes: int, num_processes: int, world_size: int
    ) -> Any:
        return default_mesh(mesh, sharding_strategy, device_type, num_nodes, num_processes, world_size)

    def shard(self, door: Any, model: Module) -> Module:
        return shard(door, model)

    def adopt_wrapped(self, door: Any, model: Module, lightning_setup: Callable[[Module], Module]) -> Module:
        """Sharded in place before (validate/test/predict after fit, a second ``setup_module``): as it is. Units
        made by ``wrap()`` below a plain root: the root is sharded with the rest of the model."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return model
        _sharding.refuse_pretrained_when_wrapped(door)
        return shard(door, model)

    def wrap_context(self, door: Any) -> AbstractContextManager:
        """``wrap(module)`` calls while the model is built apply ``fully_shard`` to ``module`` with the door's
        arguments (the units of :func:`shard`); the root follows when the door sets the model up."""
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=functools.partial(_wrap_unit, door))

    def set_up(self, door: Any, model: Module, lightning_setup: Callable[[Module], Module]) -> Module:
        # sharded before (validate/test/predict after fit), or units wrapped by hand in configure_model: the root
        # recorded stays the same in the first case
        if self.owns(model):
            return self.adopt_wrapped(door, model, lightning_setup)
        return shard(door, model)

    def step(
        self,
        door: Any,
        name: str,
        context: Callable[[], AbstractContextManager],
        lightning_step: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        # FSDP2 shards the LightningModule in place (the door's model is the module): run the step inside its
        # forward, so the root gathers its own parameters (and casts inputs) as FSDP1's wrapper does.
        module = door.lightning_module
        if module is None:
            raise RuntimeError(f"GaudiFSDPStrategy.{name}: the model is not set up")
        with context():
            return lightning_internals.redirect_forward(door, module, name, *args, **kwargs)

    def refuse_optimizers_made_before(self, optimizers: list[Any]) -> None:
        if optimizers:
            # fully_shard replaces every parameter by a new DTensor parameter: an optimizer made before holds the
            # old ones and would step nothing.
            raise NotImplementedError(
                "with fsdp_version=2, set up the model first and create the optimizer from its sharded parameters: "
                "model = fabric.setup_module(model); optimizer = fabric.setup_optimizers(AdamW(model.parameters()))"
            )

    def clip_grad_norm(self, root: Module, max_norm: float, norm_type: float) -> torch.Tensor:
        return clip_grad_norm_(root, max_norm, norm_type)  # DTensor gradients: the norm spans every rank

    def no_sync(self, module: Module) -> AbstractContextManager:
        if not is_fsdp2(module):
            raise _sharding.not_set_up_for_no_sync(module)
        return _no_sync(module)

    def mixed_precision_row(self, door: Any) -> str:
        mp = door._config.mp_policy
        if mp is None:
            return "fp32 (no FSDP mixed precision)"
        return f"param={mp.param_dtype}, reduce={mp.reduce_dtype}, output={mp.output_dtype}"

    def fingerprint(self, model: Module) -> dict[str, int]:
        return unit_names(model)

    def held_elements(self, model: Module) -> int:
        return held_elements(model)

    def unit_count(self, model: Module) -> int:
        return len(unit_names(model))

    def load_pretrained(self, model: Module, prepared: Any, device: torch.device) -> int:
        return pretrained.load_dtensors(model, prepared, device)

    # checkpoints, per format (:mod:`.fsdp2_state`, :mod:`.fsdp2_io`)
    local_layout = staticmethod(fsdp2_io.local_layout)
    check_local_layout = staticmethod(fsdp2_io.check_local_layout)
    current_state = staticmethod(fsdp2_io.current_state)
    expected_full_shapes = staticmethod(fsdp2_state.expected_full_shapes)
    apply_load = staticmethod(fsdp2_io.apply_load)

    def model_state_dict(
        self, model: Module, fmt: str, device_type: str, stream: FullStream | None = None
    ) -> dict[str, Any]:
        return fsdp2_state.model_state_dict(model, fmt, stream)

    def optimizer_state_dict(
        self, model: Module, optimizer: Any, fmt: str, device_type: str, rank: int, stream: FullStream | None = None
    ) -> dict[str, Any]:
        return fsdp2_state.optimizer_state_dict(model, optimizer, fmt, rank, stream)

    def local_shard_keys(self, current: dict[str, Any]) -> list[str]:
        return list(current)

    def load_full_optimizer(self, model: Module, optimizer: Any, state: dict[str, Any], device_type: str) -> None:
        fsdp2_io.load_full_optimizer(model, optimizer, state)


@contextmanager
def _no_sync(module: Module) -> Generator[None, None, None]:
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]


def shard(door: Any, model: Module) -> Module:
    """Shard ``model`` in place with ``fully_shard`` with the door's resolved arguments; records the root. Units made
    by ``wrap()`` while the model was built take the place of ``auto_wrap_policy``'s."""
    from torch.distributed.fsdp import FSDPModule

    prepared = _sharding.plan_pretrained(door, model)
    ignored = _sharding.resolve_ignored(door, model)
    if door._config.sync_module_states:
        _sharding.broadcast_module_states(model)
    door._cache_off_in_training = activation.apply_activation_checkpointing(
        model, door._config.activation_checkpointing_kwargs
    )
    by_hand = [m for m in post_order(model) if isinstance(m, FSDPModule)]
    policy = door._config.auto_wrap_policy
    if by_hand and policy is not None:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            "auto_wrap_policy is ignored: the model holds FSDP units wrapped by hand (wrap()); the parameters outside "
            "them go into the root unit"
        )
    units = by_hand or select_units(model, policy, ignored.get("ignored_modules", ()))
    apply_fsdp2(
        model,
        [] if by_hand else units,
        ignored_params=_ignored_parameters(ignored),
        root_casts_inputs=not door._config.keep_batch_dtypes,
        **_unit_arguments(door),
    )
    device = _sharding.fsdp_device(door)
    init_fn = pretrained.empty_init(device) if prepared is not None else door._config.param_init_fn
    materialize_meta(model, device, init_fn)
    _sharding.load_pretrained(door, model, prepared)
    _sharding.average_replicated_gradients(model, door.world_size)
    if door._config.forward_prefetch:
        set_forward_prefetch(units)
    if door.process_group_backend == "hccl":
        force_sum_reductions(model)
    lightning_internals.move_torchmetrics_to_device(model, door.root_device)
    door._fsdp_root = model
    return model


def _unit_arguments(door: Any) -> dict[str, Any]:
    """The ``fully_shard`` arguments every unit takes from the door (the root's may differ in input casting)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    return {
        "mesh": mesh(door),
        "reshard_after_forward": door._config.sharding_strategy
        in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
        "mp_policy": door._config.mp_policy or MixedPrecisionPolicy(),
        "offload_policy": _offload_policy(_sharding.effective_cpu_offload(door)) or OffloadPolicy(),
    }


def _wrap_unit(door: Any, module: Module, **overrides: Any) -> Module:
    """What ``wrap(module)`` does under ``fsdp_version=2``: ``fully_shard(module)`` with the door's arguments (after
    ``sync_module_states`` copied rank 0's values into it)."""
    from torch.distributed.fsdp import fully_shard

    if overrides:
        raise TypeError(
            f"wrap() with fsdp_version=2 takes no FSDP1 arguments, got {sorted(overrides)}; the strategy's arguments "
            "apply to every unit"
        )
    if door._config.sync_module_states:
        _sharding.broadcast_module_states(module)
    fully_shard(module, **_unit_arguments(door))
    return module


def mesh(door: Any) -> Any:
    """The device mesh every unit shards over: built once, when the process group started
    (:func:`.._platform.build_mesh`, with :meth:`FSDP2.default_mesh`)."""
    from torch.distributed.device_mesh import DeviceMesh

    built = door._config.device_mesh
    if not isinstance(built, DeviceMesh):
        raise RuntimeError(
            "fsdp_version=2 shards over the device mesh built when the process group starts; it has none"
        )
    return built


def default_mesh(
    mesh: Any, sharding_strategy: Any, device_type: str, num_nodes: int, num_processes: int, world_size: int
) -> Any:
    """``mesh`` when given, else one built on the root device's type: hybrid sharding gets one replica per node,
    sharded over the node's devices; the rest one dimension over every rank."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(mesh, DeviceMesh):
        return mesh
    with _exit.recording_group_threads():  # a group's threads, told apart at exit (see _exit)
        if sharding_strategy in (ShardingStrategy.HYBRID_SHARD, fsdp1_internals.hybrid_zero2()):
            return init_device_mesh(device_type, (num_nodes, num_processes), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (world_size,))


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
