"""``GaudiFSDPStrategy``: Lightning's FSDP strategy for Intel Gaudi, rehearsable on CPU processes over gloo."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import socket
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gaudi_fsdp import _activation_checkpointing as activation
from lightning_gaudi_fsdp import _liveness, _report, gaudi, options
from lightning_gaudi_fsdp.checkpoint import formats, loading
from lightning_gaudi_fsdp.checkpoint.background import BackgroundSaver
from lightning_gaudi_fsdp.precision import GaudiFSDPPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH

log = logging.getLogger(__name__)

_WrapPolicyInput = int | str | list[str] | set[type[Module]] | list[type[Module]] | ModuleWrapPolicy | Callable | None
_CheckpointPolicyInput = str | list[str] | set[type[Module]] | list[type[Module]] | Callable | None


class GaudiFSDPStrategy(FSDPStrategy):
    r"""Fully Sharded Data Parallel (torch FSDP1) on Intel Gaudi, in eager mode over HCCL.

    With ``Trainer(accelerator="cpu")`` the same strategy runs real FSDP in CPU processes over gloo, so a
    configuration can be rehearsed on any machine. Every argument accepts its torch object or a plain spelling
    that fits in a LightningCLI YAML file; all are checked here, before any process starts.

    Arguments:
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"``,
            ``"_HYBRID_SHARD_ZERO2"`` (any case) or a ``ShardingStrategy``.
        process_group: a process group (or the intra/inter pair for hybrid sharding); Python only.
        device_mesh: ``[replicas, shard_size]`` for hybrid sharding, built on the device type in use, or a
            ``DeviceMesh``. Its product must equal the world size.
        cpu_offload: ``True``/``False`` or a ``CPUOffload``.
        auto_wrap_policy: module classes or dotted class paths (one FSDP unit per instance), an int
            (``min_num_params`` of the size-based policy), a callable or a ``ModuleWrapPolicy``.
        backward_prefetch: ``"BACKWARD_PRE"`` (default), ``"BACKWARD_POST"`` or ``None``.
        mixed_precision: a ``MixedPrecision`` or a dict with ``param_dtype``, ``reduce_dtype``, ``buffer_dtype``
            (``"bfloat16"``, ``"bf16"``, ``"float32"``, ``"torch.float16"``, ...), ``keep_low_precision_grads``,
            ``cast_forward_inputs``, ``cast_root_forward_inputs``. It sets FSDP's parameter, gradient-reduction
            and buffer dtypes; ``Trainer(precision=...)`` still decides autocast and input casting. When both are
            given, this argument wins for FSDP's dtypes and a warning says so.
        ignored_modules: modules, or their names relative to the LightningModule, that FSDP leaves unsharded.
        ignored_states: parameters or modules (objects or names) that FSDP does not manage.
        param_init_fn: called on each module still on the meta device to materialise it (a callable or its
            dotted path). Without it, FSDP calls ``reset_parameters()`` of each meta module.
        device_id: the device FSDP runs on; default the rank's own device. Always passed as a ``torch.device``.
        sync_module_states: broadcast rank 0's parameters and buffers at wrap time.
        forward_prefetch: prefetch the next all-gather during the forward pass.
        limit_all_gathers: rate-limit all-gathers to bound device memory (default ``True``).
        use_orig_params: expose the original parameters to the optimizer (default ``True``).
        state_dict_type: checkpoint format written by saves: ``"full"`` (default), ``"sharded"`` or ``"local"``.
            Loading picks the format from what is on disk. A save that fails on any rank (full disk, read-only or
            vanished directory, permission) raises ``CheckpointSaveError`` on every rank, naming the checkpoint,
            the failed ranks and the cause; nothing is committed.
        activation_checkpointing_policy: module classes, dotted class paths or a ``(module) -> bool`` callable.
        compile: ``True`` or a dict of ``torch.compile`` arguments compiles each FSDP unit
            (``hpu_backend`` on Gaudi, ``aot_eager`` on CPU unless ``backend`` is given).
        eager_pipeline: sets ``PT_HPU_EAGER_PIPELINE_ENABLE`` for launched processes; ``False`` is Intel's
            documented switch for FSDP stability problems. ``None`` leaves the environment alone.
        process_group_backend: default ``"hccl"`` on Gaudi and ``"gloo"`` on CPU; only ``"hccl"`` works on Gaudi.
        timeout: collective timeout, a ``timedelta`` or seconds.
        fsdp_version: ``1`` (default) shards with torch's ``FullyShardedDataParallel`` (flat parameters);
            ``2`` with ``fully_shard`` (one DTensor per parameter). The same arguments apply to both; a value that
            has no FSDP2 meaning is refused here with what FSDP2 does instead (README: "The FSDP2 engine").
        check_free_space: before each save, compare the bytes every rank is about to write with the free space of
            its file system and refuse the save before anything is written when it is short. ``None`` (default)
            reads ``LIGHTNING_GAUDI_FSDP_CHECK_FREE_SPACE`` (``0`` turns it off), else on; ``False`` is for file
            systems that report free space wrongly.
        async_save: ``True`` makes saves during ``fit`` return once the state is copied into host buffers (kept
            from one save to the next); a background thread writes and commits it while training goes on, in any
            ``state_dict_type``. At most one save is in flight: the next one waits for it. An older checkpoint that
            ``ModelCheckpoint`` rotates out is removed only after the newer one committed. A background save that
            fails raises ``CheckpointSaveError`` on every rank at the next save or at the end of fit. Saves outside
            ``fit`` (or after it) stay synchronous. README: "Saving in the background".
    """

    strategy_name = "gaudi_fsdp"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
        process_group: Any = None,
        device_mesh: tuple[int, int] | list[int] | DeviceMesh | None = None,
        cpu_offload: bool | CPUOffload = False,
        auto_wrap_policy: _WrapPolicyInput = None,
        backward_prefetch: str | BackwardPrefetch | None = "BACKWARD_PRE",
        mixed_precision: dict[str, Any] | MixedPrecision | None = None,
        ignored_modules: list[str] | list[Module] | None = None,
        ignored_states: list[str] | list[Module] | list[Parameter] | None = None,
        param_init_fn: str | Callable[[Module], None] | None = None,
        device_id: int | str | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = True,
        state_dict_type: str = "full",
        activation_checkpointing_policy: _CheckpointPolicyInput = None,
        compile: bool | dict[str, Any] = False,
        eager_pipeline: bool | None = None,
        fsdp_version: int = 1,
        check_free_space: bool | None = None,
        async_save: bool = False,
    ) -> None:
        sharding = options.resolve_sharding_strategy(sharding_strategy)
        wrap_policy = options.resolve_auto_wrap_policy(auto_wrap_policy)
        mesh = options.resolve_device_mesh(device_mesh)
        options.check_hybrid_requirements(sharding, wrap_policy, process_group, mesh)
        self._state_dict_type = options.resolve_state_dict_type(state_dict_type)
        self._fsdp_version = options.resolve_fsdp_version(fsdp_version)
        prefetch = options.resolve_backward_prefetch(backward_prefetch)
        self._mp_policy = None
        if self._fsdp_version == 2:
            options.check_fsdp2_arguments(
                sharding_strategy=sharding,
                process_group=process_group,
                backward_prefetch=prefetch,
                limit_all_gathers=options.resolve_bool(limit_all_gathers, "limit_all_gathers"),
                use_orig_params=options.resolve_bool(use_orig_params, "use_orig_params"),
            )
            self._mp_policy = options.resolve_mixed_precision_policy(mixed_precision)
        else:
            options.check_state_dict_type(self._state_dict_type, sharding, mesh)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=options.resolve_process_group_backend(process_group_backend),
            timeout=options.resolve_timeout(timeout),
            cpu_offload=options.resolve_cpu_offload(cpu_offload),
            mixed_precision=options.resolve_mixed_precision(mixed_precision) if self._fsdp_version == 1 else None,
            auto_wrap_policy=wrap_policy,
            sharding_strategy=sharding,
            state_dict_type=self._state_dict_type,  # type: ignore[arg-type]
            device_mesh=mesh,
            process_group=process_group,
            backward_prefetch=prefetch,
            param_init_fn=options.resolve_callable(param_init_fn, "param_init_fn"),
            sync_module_states=options.resolve_bool(sync_module_states, "sync_module_states"),
            forward_prefetch=options.resolve_bool(forward_prefetch, "forward_prefetch"),
            limit_all_gathers=options.resolve_bool(limit_all_gathers, "limit_all_gathers"),
            use_orig_params=options.resolve_bool(use_orig_params, "use_orig_params"),
        )
        if process_group is None:
            self.kwargs.pop("process_group")
        # Kept apart from self.kwargs: Lightning would build a tuple mesh on "cuda"; we build it on our device.
        self.kwargs.pop("device_mesh", None)
        self._device_mesh = mesh
        self._ignored_modules = options.resolve_names_list(ignored_modules, "ignored_modules")
        self._ignored_states = options.resolve_names_list(ignored_states, "ignored_states")
        if self._ignored_modules is not None and self._ignored_states is not None:
            raise ValueError("ignored_modules and ignored_states are mutually exclusive; pass only one of them")
        self._device_id = options.resolve_device_id(device_id)
        self._activation_checkpointing_kwargs = options.resolve_activation_checkpointing_policy(
            activation_checkpointing_policy
        )
        self._compile_kwargs = options.resolve_compile(compile)
        self._eager_pipeline = (
            None if eager_pipeline is None else options.resolve_bool(eager_pipeline, "eager_pipeline")
        )
        self._keep_batch_dtypes = options.keeps_batch_dtypes(mixed_precision)
        self._check_free_space = (
            None if check_free_space is None else options.resolve_bool(check_free_space, "check_free_space")
        )
        self._background = BackgroundSaver(self._timeout) if options.resolve_bool(async_save, "async_save") else None
        self._fsdp_root: Module | None = None
        self._cache_off_in_training: list[str] = []  # transformers models whose KV cache is off in training
        self._heartbeat: _liveness.Heartbeat | None = None

    # ------------------------------------------------------------------------------------------- devices, backend
    @property
    def _on_hpu(self) -> bool:
        return bool(self.parallel_devices) and self.parallel_devices[0].type == "hpu"  # type: ignore[index]

    @property
    @override
    def root_device(self) -> torch.device:
        if self._on_hpu:
            return gaudi.current_device()
        return super().root_device

    @override
    def _get_process_group_backend(self) -> str:
        device_type = self.root_device.type
        backend = self._process_group_backend
        if device_type == "hpu":
            if backend not in (None, "hccl"):
                raise ValueError(
                    f"process_group_backend={backend!r} is not supported on Gaudi; expected 'hccl' (or None)"
                )
            return "hccl"
        if backend is None:
            return "gloo" if device_type == "cpu" else super()._get_process_group_backend()
        if backend == "hccl":
            raise ValueError(f"process_group_backend='hccl' needs accelerator='hpu'; this run uses {device_type!r}")
        return backend

    @override
    def _configure_launcher(self) -> None:
        self._check_mesh_size(self.num_processes * self.num_nodes)  # before any process starts
        if not self.cluster_environment.creates_processes_externally:
            _liveness.mark_launcher()  # this process starts the other ranks (Lightning's launcher)
        else:
            _liveness.leave_with_launcher()  # a rank it started (a no-op under torchrun, SLURM...)
        if self._on_hpu:
            self._get_process_group_backend()  # a wrong backend fails before any process starts
            gaudi.ensure_eager_mode()
            gaudi.apply_launch_environment(self._eager_pipeline)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        _liveness.leave_with_launcher()  # before the rendezvous: never wait for a launcher that is gone
        if self._on_hpu:
            gaudi.ensure_eager_mode()
            gaudi.import_hccl()
        super().setup_environment()
        if isinstance(self._device_mesh, tuple):
            from torch.distributed.device_mesh import init_device_mesh

            self._check_mesh_size(self.world_size)
            self._device_mesh = init_device_mesh(
                self.root_device.type, self._device_mesh, mesh_dim_names=("replicate", "shard")
            )
        if self._device_mesh is not None:
            self.kwargs["device_mesh"] = self._device_mesh
        if self.world_size > 1 and self._heartbeat is None:
            node = f"{socket.gethostname()}/node{self.node_rank}"
            self._heartbeat = _liveness.Heartbeat(self.global_rank, self.world_size, node)
            self._heartbeat.start()

    @override
    def teardown(self) -> None:
        try:
            self._finish_background_saves()
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        heartbeat = self._heartbeat
        if heartbeat is None or isinstance(exception, KeyboardInterrupt | SystemExit):
            return
        verdict = heartbeat.on_failure(exception)
        message = verdict.message(self.global_rank, self.world_size) if verdict is not None else None
        if message:
            exception.add_note(message)
            log.error(f"[rank {self.global_rank}] {message}")

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning sends ``ReduceOp.AVG`` for ``"mean"`` on every backend but gloo (``self.log(sync_dist=True)``
        and ``strategy.reduce``); HCCL offers SUM, MIN and MAX only, so on ``hccl`` a mean is a sum divided by the
        group's size."""
        if (
            isinstance(tensor, torch.Tensor)
            and self.process_group_backend == "hccl"
            and _is_mean(reduce_op)
            and torch.distributed.is_initialized()
        ):
            summed = super().reduce(tensor, group=group, reduce_op="sum")
            size = torch.distributed.get_world_size(group)
            return summed.div_(size) if torch.is_floating_point(summed) else summed.copy_(summed / size)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def _check_mesh_size(self, world_size: int) -> None:
        if isinstance(self._device_mesh, tuple) and world_size:
            replicas, shard = self._device_mesh
            if replicas * shard != world_size:
                raise ValueError(
                    f"device_mesh={list(self._device_mesh)} has {replicas * shard} devices but the world size is "
                    f"{world_size}; replicas x shard_size must equal num_nodes x devices"
                )

    # ---------------------------------------------------------------------------------------------------- precision
    @property
    @override
    def precision_plugin(self) -> GaudiFSDPPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = GaudiFSDPPrecision("32-true")
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        if precision_plugin is not None and not isinstance(precision_plugin, FSDPPrecision):
            raise TypeError(
                f"GaudiFSDPStrategy works with FSDP precision plugins only, got {type(precision_plugin).__name__}"
            )
        if isinstance(precision_plugin, FSDPPrecision) and not isinstance(precision_plugin, GaudiFSDPPrecision):
            # Lightning's connector builds a plain FSDPPrecision (CUDA autocast and scaler); swap in ours.
            # (A custom scaler cannot arrive this way: Lightning's FSDPPrecision refuses any scaler argument.)
            precision_plugin = GaudiFSDPPrecision(precision_plugin.precision)
        self._precision_plugin = precision_plugin

    # -------------------------------------------------------------------------------------------------- wrapping
    def _fsdp_device(self) -> torch.device:
        device_id = self._device_id
        if device_id is None:
            return self.root_device
        if isinstance(device_id, int):
            return torch.device(self.root_device.type, device_id)
        return torch.device(device_id)

    def _resolve_ignored(self, module: Module) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self._ignored_modules is not None:
            kwargs["ignored_modules"] = options.resolve_submodules(module, self._ignored_modules, "ignored_modules")
        if self._ignored_states is not None:
            kwargs["ignored_states"] = options.resolve_submodules(
                module, self._ignored_states, "ignored_states", allow_parameters=True
            )
        return kwargs

    @override
    def _setup_model(self, model: Module) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if self._fsdp_version == 2:
            return self._setup_fsdp2(model)
        previous = self._fsdp_root
        if previous is not None and previous.module is model:
            # trainer.validate/test/predict after fit hand back the bare LightningModule, whose FSDP children still
            # hold their shards; re-wrapping it would treat the root's sharded views as full parameters.
            model = previous
        elif any(isinstance(m, FSDP) for m in model.modules()):
            model = super()._setup_model(model)  # applies self._activation_checkpointing_kwargs too
            if self._activation_checkpointing_kwargs:
                self._cache_off_in_training = activation.apply_cache_off_in_training(model)
        else:
            self._warn_if_precision_overlaps()
            kwargs = dict(self.kwargs)
            if kwargs.get("sync_module_states") and self._fsdp_device().type == "cpu":
                # torch refuses sync_module_states for CPU tensors although gloo broadcasts them fine.
                _broadcast_module_states(model)
                kwargs["sync_module_states"] = False
            model = FSDP(
                module=model,
                cpu_offload=self._effective_cpu_offload(),
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self._fsdp_device(),
                **self._resolve_ignored(model),
                **kwargs,
            )
            _move_torchmetrics_to_device(model, self.root_device)
            self._cache_off_in_training = activation.apply_activation_checkpointing(
                model, self._activation_checkpointing_kwargs
            )
        self._fsdp_root = model if isinstance(model, FSDP) else None
        if self._fsdp_root is not None and self._keep_batch_dtypes:
            # The units below cast their own inputs; the root (the LightningModule) leaves the batch as it is.
            self._fsdp_root.mixed_precision = dataclasses.replace(
                self._fsdp_root.mixed_precision, cast_forward_inputs=False, cast_root_forward_inputs=False
            )
        if self._compile_kwargs is not None and previous is not model:
            _report.compiled_units(_apply_compile(model, self._compile_kwargs, self.root_device.type))
        self.precision_plugin.attach(model)
        return model

    def _setup_fsdp2(self, model: Module) -> Module:
        from lightning_gaudi_fsdp.engine import fsdp2

        if fsdp2.is_fsdp2(model):  # validate/test/predict after fit: already sharded in place
            return model
        ignored = self._resolve_ignored(model)
        ignored_params = _ignored_parameters(ignored)
        if self.kwargs.get("sync_module_states"):
            _broadcast_module_states(model)
        self._cache_off_in_training = activation.apply_activation_checkpointing(
            model, self._activation_checkpointing_kwargs
        )
        units = fsdp2.select_units(model, self.kwargs.get("auto_wrap_policy"), ignored.get("ignored_modules", ()))
        fsdp2.apply_fsdp2(
            model,
            units,
            mesh=self._fsdp2_mesh(),
            reshard_after_forward=self.sharding_strategy
            in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
            mp_policy=self._mp_policy,
            offload_policy=self._fsdp2_offload_policy(),
            ignored_params=ignored_params,
            root_casts_inputs=not self._keep_batch_dtypes,
        )
        param_init_fn = self.kwargs.get("param_init_fn")
        fsdp2.materialize_meta(model, self._fsdp_device(), param_init_fn)
        if self.kwargs.get("forward_prefetch"):
            fsdp2.set_forward_prefetch(units)
        if self.process_group_backend == "hccl":
            fsdp2.force_sum_reductions(model)
        _move_torchmetrics_to_device(model, self.root_device)
        self._fsdp_root = model
        if self._compile_kwargs is not None:
            _report.compiled_units(_apply_compile(model, self._compile_kwargs, self.root_device.type))
        self.precision_plugin.attach(model)
        return model

    def _fsdp2_mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = self._device_mesh
        if isinstance(mesh, DeviceMesh):
            return mesh
        if self.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            # (replicate, shard): default one replica per node, sharded over the node's devices
            shape = (self.num_nodes, self.num_processes)
            self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))
        else:
            self._device_mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        return self._device_mesh

    def _fsdp2_offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload = self._effective_cpu_offload()
        return CPUOffloadPolicy() if offload.offload_params else None

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # For `wrap()` calls inside configure_model: the same arguments as the automatic wrapping, with a device.
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import enable_wrap

        kwargs = {k: v for k, v in self.kwargs.items() if k != "auto_wrap_policy"}
        with enable_wrap(
            wrapper_cls=FSDP,
            cpu_offload=self._effective_cpu_offload(warn=False),
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._fsdp_device(),
            **kwargs,
        ):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.precision_plugin.set_device_type(self.root_device.type)
        super().setup(trainer)
        held_per_rank = self._check_ranks_agree()
        if trainer.state.fn == TrainerFn.FITTING and self.global_rank == 0:
            rank_zero_info(_report.configuration_table(self, held_per_rank))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module, root = self.lightning_module, self._fsdp_root
        if self._fsdp_version == 2:
            return self._through_fsdp2_root("training_step", self.precision_plugin.train_step_context, args, kwargs)
        if module is None or module.automatic_optimization or root is None:
            return super().training_step(*args, **kwargs)
        # Manual optimization: Lightning would run the whole training_step inside the root's forward, where FSDP
        # cannot run manual_backward. Run it outside, and send the module's own forward (``self(x)``) through the
        # root, as Fabric users call their wrapped model.
        with self.precision_plugin.train_step_context(), _forward_through_root(root, module):
            return module.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._fsdp_version == 2:
            return self._through_fsdp2_root("validation_step", self.precision_plugin.val_step_context, args, kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._fsdp_version == 2:
            return self._through_fsdp2_root("test_step", self.precision_plugin.test_step_context, args, kwargs)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._fsdp_version == 2:
            return self._through_fsdp2_root("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        return super().predict_step(*args, **kwargs)

    def _through_fsdp2_root(
        self, method: str, context: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # FSDP2 shards the LightningModule in place (self.model is the module): run the step inside its forward,
        # so the root gathers its own parameters (and casts inputs) as FSDP1's wrapper does.
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"GaudiFSDPStrategy.{method}: the model is not set up")
        with context():
            return self._forward_redirection(module, module, method, *args, **kwargs)

    def _check_ranks_agree(self) -> list[int]:
        """Ranks that wrapped the model differently would deadlock or corrupt in the first collective: compare a
        fingerprint of the wrapping on every rank first and fail on all of them with the difference. Returns the
        flat-parameter elements each rank holds."""
        model = self._wrapped_model()
        fingerprint = _report.fingerprint(model, self.sharding_strategy.name)
        gathered_pairs = self._gather_objects((fingerprint, _report.held_elements(model)))
        gathered = [pair[0] for pair in gathered_pairs]
        for rank, other in enumerate(gathered):
            if other != fingerprint:
                diff = _report.describe_difference(gathered[0], other)
                raise ValueError(
                    f"ranks disagree on the FSDP configuration (rank 0 vs rank {rank}: {diff}); every rank must "
                    "build the same model with the same strategy arguments"
                )
        return [pair[1] for pair in gathered_pairs]

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        if not self.kwargs.get("use_orig_params"):
            module = self.lightning_module
            optimizers = module.configure_optimizers() if module is not None else None
            groups = _count_param_groups(optimizers)
            if groups > 1:
                raise ValueError(
                    f"configure_optimizers returned {groups} parameter groups, which needs use_orig_params=True "
                    "(with use_orig_params=False FSDP flattens each unit into one parameter and the groups cannot be "
                    "kept apart)"
                )
        super().setup_optimizers(trainer)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._compile_kwargs is not None:
            # FSDP keeps the sharded gradient on the flat parameter while the next forward unshards its data;
            # dynamo cannot trace a tensor whose .grad has another size. The step consumed the gradients and the
            # next backward would zero them anyway, so drop them now.
            optimizer.zero_grad(set_to_none=True)
        return output

    def _effective_cpu_offload(self, warn: bool = True) -> CPUOffload:
        if self.cpu_offload.offload_params and self._fsdp_device().type == "cpu":
            # FSDP pins offloaded shards, which needs an accelerator; on a CPU run they already live in CPU memory.
            if warn:
                rank_zero_warn("cpu_offload=True has no effect when the model already runs on the CPU; it is ignored.")
            return CPUOffload(offload_params=False)
        return self.cpu_offload

    def _warn_if_precision_overlaps(self) -> None:
        plugin_precision = self.precision_plugin.precision
        if self.mixed_precision is not None and plugin_precision != "32-true":
            rank_zero_warn(
                f"GaudiFSDPStrategy(mixed_precision=...) sets FSDP's parameter/reduce/buffer dtypes and overrides the "
                f"dtypes Trainer(precision={plugin_precision!r}) would choose for them; autocast and input casting "
                "still follow the Trainer's precision."
            )

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _wrapped_model(self) -> Module:
        if self.model is None or self.lightning_module is None:
            raise RuntimeError("GaudiFSDPStrategy: the model is not set up yet; call this inside trainer.fit/validate")
        return self.model

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        model = self._wrapped_model()
        return formats.model_state_dict(model, self._state_dict_type, self.root_device.type)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        model = self._wrapped_model()
        return formats.optimizer_state_dict(
            model, optimizer, self._state_dict_type, self.root_device.type, self.global_rank
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("GaudiFSDPStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        metadata = None
        if self._state_dict_type == "local":
            model = self._wrapped_model()
            metadata = formats.local_metadata(
                model,
                self.sharding_strategy.name,
                _report.versions(),
                self.optimizers if "optimizer_states" in checkpoint else (),
            )
        checkpoint[formats.ENGINE_KEY] = self._fsdp_version
        if self._state_dict_type == "full" and checkpoint.get("optimizer_states"):
            checkpoint[formats.PARAM_ID_NAMES_KEY] = formats.param_id_names(self._wrapped_model())
        save = functools.partial(
            formats.save,
            self._state_dict_type,
            path=path,
            rank=self.global_rank,
            world_size=self.world_size,
            local_metadata=metadata,
            check_free_space=self._check_free_space,
        )
        background = self._background
        if background is not None and background.active:
            background.save(
                checkpoint,
                path,
                lambda staged, gather, group: save(staged, gather=gather, process_group=group),
                rank=self.global_rank,
                gather=self._gather_objects,
            )
            return
        save(checkpoint, gather=self._gather_objects)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        # With async_save, ModelCheckpoint asks to remove the checkpoint it replaces right after save_checkpoint
        # returns, before the newer one is written: that removal waits until the newer one has committed.
        background = self._background
        if background is not None and background.active:
            background.defer_removal(functools.partial(super().remove_checkpoint, filepath))
            return
        super().remove_checkpoint(filepath)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._background is not None:
            self._background.active = True  # until teardown, which waits for the last save

    def _finish_background_saves(self) -> None:
        if self._background is None:
            return
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        self._background.finish(rank=self.global_rank, gather=self._gather_objects, interrupted=interrupted)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Check ``checkpoint_path`` on every rank, then load it. ``weights_only`` is the one given to
        ``Trainer.fit/validate/test/predict(..., weights_only=...)`` (Lightning >= 2.6; see :func:`_fit_weights_only`):
        ``None`` (torch's default) and ``True`` unpickle every file safely, ``False`` without restriction, for a
        checkpoint whose source is trusted. Lightning 2.5 has no such argument: loading is always safe there."""
        model = self._wrapped_model()
        if weights_only is None:
            weights_only = _fit_weights_only(self.lightning_module.trainer)
        path = Path(self.broadcast(str(checkpoint_path)))
        strict = self.lightning_module.strict_loading
        device_type = self.root_device.type
        pending, error = None, None
        try:
            pending = loading.check_load(
                path,
                model,
                world_size=self.world_size,
                rank=self.global_rank,
                device_type=device_type,
                strict=strict,
                weights_only=weights_only is not False,
            )
        except formats.CheckpointError as err:
            error = err.problem
        # Every rank learns of any rank's problem before weights change: nobody waits in a collective alone.
        errors = self._gather_objects(error)
        failed = [(rank, msg) for rank, msg in enumerate(errors) if msg]
        if failed or pending is None:
            rank, problem = failed[0] if failed else (self.global_rank, str(error))
            raise formats.CheckpointError(path, f"{problem} (reported by rank {rank})")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return loading.apply_load(
            pending,
            model,
            self.optimizers,
            device_type=device_type,
            strict=strict,
            load_optimizers=fitting and bool(self.optimizers),
        )

    def _gather_objects(self, obj: Any) -> list[Any]:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    # -------------------------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "FSDP on Intel Gaudi (eager mode, HCCL); CPU processes over gloo for rehearsal"
        for name in ("gaudi_fsdp", "hpu_fsdp"):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description)


def _fit_weights_only(trainer: pl.Trainer | None) -> bool | None:
    """The ``weights_only`` given to the running ``trainer.fit/validate/test/predict``, or None.

    Lightning 2.6 passes it to ``Strategy.load_checkpoint`` only for strategies that restore before setup; for those
    that restore after it (FSDP among them) ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)``
    without it, so a user's ``weights_only=False`` would never arrive. It is read from that call's frame instead."""
    frame = inspect.currentframe()
    try:
        while frame is not None and trainer is not None:
            if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
                value = frame.f_locals.get("weights_only")
                return value if isinstance(value, bool) else None
            frame = frame.f_back
        return None
    finally:
        del frame  # no reference cycle through this frame


@contextmanager
def _forward_through_root(root: Module, module: pl.LightningModule) -> Generator[None, None, None]:
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
        if not inside and torch._C._current_graph_task_id() == -1:
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


def _apply_compile(model: Module, kwargs: Mapping[str, Any], device_type: str) -> list[str]:
    """Compile the FSDP root in place (``nn.Module.compile``): the module stays an FSDP instance, so checkpoint
    contexts keep working, and dynamo traces through FSDP's hooks (it needs ``use_orig_params=True``)."""
    kwargs = dict(kwargs)
    kwargs.setdefault("backend", gaudi.default_compile_backend(device_type))
    gaudi.prepare_compile_backend(kwargs["backend"])
    model.compile(**kwargs)
    return [""]


def _broadcast_module_states(module: Module) -> None:
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


def _count_param_groups(optimizers: Any) -> int:
    from torch.optim import Optimizer

    found: list[Optimizer] = []

    def visit(item: Any) -> None:
        if isinstance(item, Optimizer):
            found.append(item)
        elif isinstance(item, dict):
            visit(item.get("optimizer"))
        elif isinstance(item, list | tuple):
            for sub in item:
                visit(sub)

    visit(optimizers)
    return max((len(opt.param_groups) for opt in found), default=0)


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


def _is_mean(reduce_op: Any) -> bool:
    from torch.distributed import ReduceOp

    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == ReduceOp.AVG
