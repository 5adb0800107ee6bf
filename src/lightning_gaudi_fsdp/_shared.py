"""What the two front doors (the Trainer's ``strategy.GaudiFSDPStrategy`` and Fabric's ``fabric.GaudiFSDPStrategy``)
have in common, written once: argument resolution, the Gaudi runtime around devices, backend, launcher and process
group, sharding a module with either engine, the rank-agreement check and start table, gradient clipping and HCCL
reductions (checkpoints: :mod:`._checkpoints`).

Lightning's Trainer and Fabric ``FSDPStrategy`` classes share no base beyond ``ParallelStrategy`` of different
packages, so the functions here take the strategy object itself (``door``) and read the attributes both doors have:
Lightning's (``kwargs``, ``sharding_strategy``, ``cpu_offload``, ``mixed_precision_config``, ``root_device``,
``world_size``, ``num_nodes``, ``num_processes``, ``parallel_devices``, ``process_group_backend``) and the ones
:func:`adopt` sets from the resolved arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import socket
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.nn import Module, Parameter

from lightning_gaudi_fsdp import _activation_checkpointing as activation
from lightning_gaudi_fsdp import _exit, _liveness, _preemption, _report, gaudi, options
from lightning_gaudi_fsdp.checkpoint import pretrained

log = logging.getLogger("lightning_gaudi_fsdp")


# ------------------------------------------------------------------------------------------------------- arguments
@dataclasses.dataclass(frozen=True)
class Resolved:
    """Every constructor argument, checked and in the form the strategies use."""

    parent: dict[str, Any]  # arguments of Lightning's FSDPStrategy.__init__ (Trainer's and Fabric's take the same)
    process_group: Any
    device_mesh: Any
    state_dict_type: str
    fsdp_version: int
    mp_policy: Any
    ignored_modules: Any
    ignored_states: Any
    device_id: Any
    activation_checkpointing_kwargs: dict[str, Any]
    compile_kwargs: dict[str, Any] | None
    eager_pipeline: bool | None
    keep_batch_dtypes: bool
    check_free_space: bool | None
    checkpoint_crc32: bool
    pretrained: pretrained.Weights | None
    failure_timeout: float  # seconds: argument, else LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT, else 60
    stuck_timeout: float | None  # seconds a rank may wait in one collective before the stuck rank is named; off
    preemption: str  # "save" or "exit"
    preemption_grace: float  # seconds from a SIGTERM until every rank has left


def resolve(
    *,
    process_group_backend: str | None = None,
    timeout: timedelta | float | None = default_pg_timeout,
    sharding_strategy: Any = "FULL_SHARD",
    process_group: Any = None,
    device_mesh: Any = None,
    cpu_offload: Any = False,
    auto_wrap_policy: Any = None,
    backward_prefetch: Any = "BACKWARD_PRE",
    mixed_precision: Any = None,
    ignored_modules: Any = None,
    ignored_states: Any = None,
    param_init_fn: Any = None,
    device_id: Any = None,
    sync_module_states: Any = False,
    forward_prefetch: Any = False,
    limit_all_gathers: Any = True,
    use_orig_params: Any = True,
    state_dict_type: Any = "full",
    activation_checkpointing_policy: Any = None,
    compile: Any = False,
    eager_pipeline: Any = None,
    fsdp_version: Any = 1,
    check_free_space: Any = None,
    checkpoint_crc32: Any = False,
    pretrained_weights: Any = None,
    pretrained_prefix: Any = "",
    failure_timeout: Any = None,
    stuck_timeout: Any = None,
    preemption: Any = "save",
    preemption_grace: Any = _preemption.DEFAULT_GRACE_S,
) -> Resolved:
    """Check and convert the arguments both strategies take (same checks, same messages, before any process). The
    defaults here are those of both strategies (the Trainer's spells them out again in its signature, which
    LightningCLI reads; a test keeps the two equal)."""
    sharding = options.resolve_sharding_strategy(sharding_strategy)
    wrap_policy = options.resolve_auto_wrap_policy(auto_wrap_policy)
    mesh = options.resolve_device_mesh(device_mesh)
    options.check_hybrid_requirements(sharding, wrap_policy, process_group, mesh)
    state_dict_type = options.resolve_state_dict_type(state_dict_type)
    version = options.resolve_fsdp_version(fsdp_version)
    prefetch = options.resolve_backward_prefetch(backward_prefetch)
    limit = options.resolve_bool(limit_all_gathers, "limit_all_gathers")
    orig = options.resolve_bool(use_orig_params, "use_orig_params")
    mp_policy = None
    if version == 2:
        options.check_fsdp2_arguments(
            sharding_strategy=sharding,
            process_group=process_group,
            backward_prefetch=prefetch,
            limit_all_gathers=limit,
            use_orig_params=orig,
        )
        mp_policy = options.resolve_mixed_precision_policy(mixed_precision)
    else:
        options.check_state_dict_type(state_dict_type, sharding, mesh)
    parent = {
        "process_group_backend": options.resolve_process_group_backend(process_group_backend),
        "timeout": options.resolve_timeout(timeout),
        "cpu_offload": options.resolve_cpu_offload(cpu_offload),
        "mixed_precision": options.resolve_mixed_precision(mixed_precision) if version == 1 else None,
        "auto_wrap_policy": wrap_policy,
        "sharding_strategy": sharding,
        "state_dict_type": state_dict_type,
        "device_mesh": mesh,
        "process_group": process_group,
        "backward_prefetch": prefetch,
        "param_init_fn": options.resolve_callable(param_init_fn, "param_init_fn"),
        "sync_module_states": options.resolve_bool(sync_module_states, "sync_module_states"),
        "forward_prefetch": options.resolve_bool(forward_prefetch, "forward_prefetch"),
        "limit_all_gathers": limit,
        "use_orig_params": orig,
    }
    weights = pretrained.resolve(pretrained_weights, pretrained_prefix)
    if weights is not None and parent["param_init_fn"] is not None:
        raise ValueError(
            "param_init_fn and pretrained_weights cannot be combined: with pretrained_weights the strategy builds "
            "the parameters on the meta device and fills them from the file (PEFT adapters as PEFT initialises them)"
        )
    if weights is not None and parent["sync_module_states"]:
        raise ValueError(
            "sync_module_states=True and pretrained_weights cannot be combined: every rank reads its own shards from "
            "the file, there is no rank 0 model to broadcast"
        )
    ignored_modules = options.resolve_names_list(ignored_modules, "ignored_modules")
    ignored_states = options.resolve_names_list(ignored_states, "ignored_states")
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("ignored_modules and ignored_states are mutually exclusive; pass only one of them")
    return Resolved(
        parent=parent,
        process_group=process_group,
        device_mesh=mesh,
        state_dict_type=state_dict_type,
        fsdp_version=version,
        mp_policy=mp_policy,
        ignored_modules=ignored_modules,
        ignored_states=ignored_states,
        device_id=options.resolve_device_id(device_id),
        activation_checkpointing_kwargs=options.resolve_activation_checkpointing_policy(
            activation_checkpointing_policy
        ),
        compile_kwargs=options.resolve_compile(compile),
        eager_pipeline=None if eager_pipeline is None else options.resolve_bool(eager_pipeline, "eager_pipeline"),
        keep_batch_dtypes=options.keeps_batch_dtypes(mixed_precision),
        check_free_space=None
        if check_free_space is None
        else options.resolve_bool(check_free_space, "check_free_space"),
        checkpoint_crc32=options.resolve_bool(checkpoint_crc32, "checkpoint_crc32"),
        pretrained=weights,
        failure_timeout=_liveness.failure_timeout(options.resolve_seconds(failure_timeout, "failure_timeout")),
        stuck_timeout=options.resolve_seconds(stuck_timeout, "stuck_timeout"),
        preemption=options.resolve_preemption(preemption),
        preemption_grace=options.resolve_preemption_grace(preemption_grace),
    )


def resolve_from(arguments: Mapping[str, Any]) -> Resolved:
    """:func:`resolve` with the arguments of a strategy's ``__init__`` (its ``locals()``)."""
    return resolve(**{name: arguments[name] for name in inspect.signature(resolve).parameters})


def resolve_keywords(door: str, arguments: Mapping[str, Any]) -> Resolved:
    """:func:`resolve` with keyword arguments a strategy passes on as given; an unknown name is a ``TypeError``
    naming ``door``."""
    known = inspect.signature(resolve).parameters
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        raise TypeError(f"{door} got unexpected keyword argument(s) {unknown}; it takes {sorted(known)}")
    return resolve(**arguments)


def adopt(door: Any, resolved: Resolved, kwargs: dict[str, Any]) -> None:
    """After Lightning's ``__init__``: keep the resolved arguments on the strategy (``kwargs``: the FSDP keyword
    arguments Lightning collected)."""
    if resolved.process_group is None:
        kwargs.pop("process_group", None)
    # Kept apart from the kwargs: Lightning would build a tuple mesh on "cuda"; it is built on our device.
    kwargs.pop("device_mesh", None)
    door._device_mesh = resolved.device_mesh
    door._state_dict_type = resolved.state_dict_type
    door._fsdp_version = resolved.fsdp_version
    door._mp_policy = resolved.mp_policy
    door._ignored_modules = resolved.ignored_modules
    door._ignored_states = resolved.ignored_states
    door._device_id = resolved.device_id
    door._activation_checkpointing_kwargs = resolved.activation_checkpointing_kwargs
    door._compile_kwargs = resolved.compile_kwargs
    door._eager_pipeline = resolved.eager_pipeline
    door._keep_batch_dtypes = resolved.keep_batch_dtypes
    door._check_free_space = resolved.check_free_space
    door._checkpoint_crc32 = resolved.checkpoint_crc32
    door._pretrained = resolved.pretrained
    door._failure_timeout = resolved.failure_timeout
    door._stuck_timeout = resolved.stuck_timeout
    door._preemption = resolved.preemption
    door._preemption_grace = resolved.preemption_grace
    door._preempt = None  # the SIGTERM watcher while one runs (preemption="save")
    door._fsdp_root = None
    door._cache_off_in_training = []  # transformers models whose KV cache is off in training
    door._heartbeat = None


# --------------------------------------------------------------------------------------- devices, backend, launch
class GaudiPlatform:
    """Mixed in before Lightning's ``FSDPStrategy`` (the Trainer's or Fabric's): the root device, the process-group
    backend, the launcher checks, the process group on Gaudi and the liveness heartbeat (each door stops it in
    ``teardown`` and reports failures through it: the Trainer in ``on_exception``, both from ``sys.excepthook``)."""

    @property
    def _on_hpu(self) -> bool:
        return on_hpu(self)

    @property
    def root_device(self) -> torch.device:
        if self._on_hpu:
            return gaudi.current_device()
        return super().root_device  # type: ignore[misc]

    def _get_process_group_backend(self) -> str:
        return process_group_backend(
            self.root_device.type,
            self._process_group_backend,  # type: ignore[attr-defined]
            super()._get_process_group_backend,  # type: ignore[misc]
        )

    def _configure_launcher(self) -> None:
        before_launch(self)
        super()._configure_launcher()  # type: ignore[misc]

    def setup_environment(self) -> None:
        before_process_group(self)
        existed = torch.distributed.is_available() and torch.distributed.is_initialized()
        # The rendezvous (and the mesh, the heartbeat's first contact) need every rank: bounded by failure_timeout.
        with _liveness.bounded_rendezvous(
            self._failure_timeout,  # type: ignore[attr-defined]
            lambda: (self.global_rank, self.world_size),  # type: ignore[attr-defined]
            lambda: launched_pids(self),
        ):
            super().setup_environment()  # type: ignore[misc]
            if not existed and torch.distributed.is_initialized():
                _exit.created_default_group()  # destroyed at interpreter exit unless the script does it
            after_process_group(self)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``gaudi_fsdp`` and ``hpu_fsdp`` (lightning-habana's name), where free, in the Trainer's or Fabric's
        registry."""
        description = "FSDP on Intel Gaudi (eager mode, HCCL); CPU processes over gloo for rehearsal"
        for name in ("gaudi_fsdp", "hpu_fsdp"):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description)


def launched_pids(door: Any) -> dict[int, int]:
    """The ranks this process started with Lightning's launcher, global rank to pid (none elsewhere). The launcher
    starts local ranks 1, 2, ... of its node, in that order."""
    procs = getattr(getattr(door, "launcher", None), "procs", None) or []
    first = door.node_rank * door.num_processes + 1
    return {first + i: proc.pid for i, proc in enumerate(procs)}


def on_hpu(door: Any) -> bool:
    return bool(door.parallel_devices) and door.parallel_devices[0].type == "hpu"


def process_group_backend(device_type: str, backend: str | None, default: Callable[[], str]) -> str:
    """``hccl`` on Gaudi (nothing else), ``gloo`` on CPU unless given, Lightning's ``default`` elsewhere."""
    if device_type == "hpu":
        if backend not in (None, "hccl"):
            raise ValueError(f"process_group_backend={backend!r} is not supported on Gaudi; expected 'hccl' (or None)")
        return "hccl"
    if backend is None:
        return "gloo" if device_type == "cpu" else default()
    if backend == "hccl":
        raise ValueError(f"process_group_backend='hccl' needs accelerator='hpu'; this run uses {device_type!r}")
    return backend


def check_mesh_size(mesh: Any, world_size: int) -> None:
    if isinstance(mesh, tuple) and world_size:
        replicas, shard = mesh
        if replicas * shard != world_size:
            raise ValueError(
                f"device_mesh={list(mesh)} has {replicas * shard} devices but the world size is "
                f"{world_size}; replicas x shard_size must equal num_nodes x devices"
            )


def before_launch(door: Any) -> None:
    """In ``_configure_launcher``: what must fail (or be set) before any process starts."""
    check_mesh_size(door._device_mesh, door.num_processes * door.num_nodes)
    if not door.cluster_environment.creates_processes_externally:
        _liveness.mark_launcher()  # this process starts the other ranks (Lightning's launcher)
    else:
        _liveness.leave_with_launcher()  # a rank it started (a no-op under torchrun, SLURM...)
    if on_hpu(door):
        door._get_process_group_backend()  # a wrong backend fails before any process starts
        gaudi.ensure_eager_mode()
        gaudi.apply_launch_environment(door._eager_pipeline)


def before_process_group(door: Any) -> None:
    """In ``setup_environment``, before Lightning creates the process group."""
    _liveness.leave_with_launcher()  # before the rendezvous: never wait for a launcher that is gone
    if on_hpu(door):
        gaudi.ensure_eager_mode()
        gaudi.import_hccl()


def after_process_group(door: Any) -> None:
    """In ``setup_environment``, once the process group exists: the hybrid mesh on our device, the heartbeat."""
    if isinstance(door._device_mesh, tuple):
        from torch.distributed.device_mesh import init_device_mesh

        check_mesh_size(door._device_mesh, door.world_size)
        door._device_mesh = init_device_mesh(
            door.root_device.type, door._device_mesh, mesh_dim_names=("replicate", "shard")
        )
    if door._device_mesh is not None:
        door.kwargs["device_mesh"] = door._device_mesh
    if door.world_size > 1 and door._heartbeat is None:
        node = f"{socket.gethostname()}/node{door.node_rank}"
        door._heartbeat = _liveness.Heartbeat(
            door.global_rank, door.world_size, node, bound_s=door._failure_timeout, stuck_s=door._stuck_timeout
        )
        door._heartbeat.start()
        # An exception that ends the script outside the door's own hooks (Fabric has none; after the Trainer's
        # teardown, a script's own collective) still names the rank that was lost.
        _liveness.report_uncaught(door._heartbeat)
    _preemption.arm(door)


def stop_heartbeat(door: Any) -> None:
    if door._heartbeat is not None:
        door._heartbeat.stop()
        door._heartbeat = None


def reduce_on_hccl(tensor: Any, group: Any, reduce_op: Any, backend: str | None, reduce: Callable[..., Any]) -> Any:
    """HCCL offers SUM, MIN and MAX only (Lightning sends ``ReduceOp.AVG`` for ``"mean"`` on every backend but gloo):
    on ``hccl`` a mean is a sum divided by the group's size. ``reduce(tensor, group=, reduce_op=)``: Lightning's."""
    if (
        isinstance(tensor, torch.Tensor)
        and backend == "hccl"
        and _is_mean(reduce_op)
        and torch.distributed.is_initialized()
    ):
        summed = reduce(tensor, group=group, reduce_op="sum")
        size = torch.distributed.get_world_size(group)
        return summed.div_(size) if torch.is_floating_point(summed) else summed.copy_(summed / size)
    return reduce(tensor, group=group, reduce_op=reduce_op)


def _is_mean(reduce_op: Any) -> bool:
    from torch.distributed import ReduceOp

    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == ReduceOp.AVG


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


# ------------------------------------------------------------------------------------------------------- wrapping
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
    from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device
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
        if "requires_grad=True and False" not in str(err):
            raise
        raise ValueError(_mixed_requires_grad_message(str(err))) from err
    _move_torchmetrics_to_device(model, door.root_device)
    load_pretrained(door, model, prepared)
    door._cache_off_in_training = activation.apply_activation_checkpointing(
        model, door._activation_checkpointing_kwargs
    )
    keep_batch_dtypes(door, model)
    return model


def _mixed_requires_grad_message(torch_message: str) -> str:
    unit = torch_message.split(" has both", 1)[0]
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
    written = pretrained.load(model, prepared, fsdp_device(door))
    log.info(
        "rank %d: %d pretrained elements read from %s into its shards",
        door.global_rank,
        written,
        door._pretrained.path,
    )


def setup_hand_wrapped(door: Any, model: Module, lightning_setup: Callable[[Module], Module]) -> Module:
    """A model whose FSDP units the user wrapped by hand (``wrap()`` in ``configure_model`` or under
    ``fabric.init_module()``), on either door: Lightning's own setup (``lightning_setup``, which also applies
    activation checkpointing), then the KV cache of checkpointed ``transformers`` models off in training, as for a
    model the strategy wraps, and the batch dtypes kept at the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plan_pretrained(door, model)  # refuses pretrained_weights for a model wrapped by hand
    model = lightning_setup(model)
    if door._activation_checkpointing_kwargs:
        door._cache_off_in_training = activation.apply_cache_off_in_training(model)
    if isinstance(model, FSDP):
        keep_batch_dtypes(door, model)
    return model


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
    from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device

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
    _move_torchmetrics_to_device(model, door.root_device)
    door._fsdp_root = model
    return model


def fsdp2_mesh(door: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = door._device_mesh
    if isinstance(mesh, DeviceMesh):
        return mesh
    device_type = door.root_device.type
    if door.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
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


def check_ranks_agree(door: Any, model: Module) -> list[int]:
    """Ranks that wrapped the model differently would deadlock or corrupt in the first collective: compare a
    fingerprint of the wrapping on every rank first and fail on all of them with the difference. Returns the
    flat-parameter elements (FSDP1) or parameter-shard elements (FSDP2) each rank holds."""
    fingerprint = _report.fingerprint(model, door.sharding_strategy.name)
    gathered_pairs = gather_objects((fingerprint, _report.held_elements(model)), door.world_size)
    message = _report.disagreement([pair[0] for pair in gathered_pairs])
    if message is not None:
        raise ValueError(message)
    return [pair[1] for pair in gathered_pairs]


def announce(door: Any, model: Module, precision: tuple[str, str], show: bool = True) -> None:
    """Once the model is set up: every rank checks that all ranks wrapped it alike (:func:`check_ranks_agree`), then
    rank 0 prints the configuration table (when ``show``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    held_per_rank = check_ranks_agree(door, model)
    if show and door.global_rank == 0:
        rank_zero_info(_report.configuration_table(door, model, held_per_rank, precision))
