"""``GaudiFSDPStrategy``: Lightning's FSDP strategy for Intel Gaudi, rehearsable on CPU processes over gloo."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gaudi_fsdp import (
    _checkpoints,
    _config,
    _liveness,
    _platform,
    _preemption,
    _report,
    _resume,
    _sharding,
    precision,
)
from lightning_gaudi_fsdp.adapters import lightning_internals
from lightning_gaudi_fsdp.checkpoint.streaming import FullStream
from lightning_gaudi_fsdp.precision import GaudiFSDPPrecision

if TYPE_CHECKING:
    from lightning_gaudi_fsdp.adapters.lightning_internals import PATH as _PATH


class GaudiFSDPStrategy(_platform.GaudiPlatform, FSDPStrategy):
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
        device_id: the device FSDP runs on; default the rank's own device. Always passed as a ``torch.device``. On
            Gaudi each process addresses its own device as ``hpu:0`` (the bridge selects no device by index): only
            ``None``, ``0``, ``"hpu"``, ``"hpu:0"`` are accepted there, anything else is refused before any process.
        sync_module_states: broadcast rank 0's parameters and buffers at wrap time.
        forward_prefetch: prefetch the next all-gather during the forward pass.
        limit_all_gathers: rate-limit all-gathers to bound device memory (default ``True``).
        use_orig_params: expose the original parameters to the optimizer (default ``True``).
        state_dict_type: checkpoint format written by saves: ``"full"`` (default), ``"sharded"`` or ``"local"``.
            Loading picks the format from what is on disk. A save that fails on any rank (full disk, read-only or
            vanished directory, permission) raises ``CheckpointSaveError`` on every rank, naming the checkpoint,
            the failed ranks and the cause; nothing is committed. A ``"full"`` save streams: rank 0 writes
            each tensor as it arrives instead of gathering the whole state first, unless an ``on_save_checkpoint``
            hook (LightningModule, datamodule, callback, precision plugin) reads the checkpoint before it is written.
        activation_checkpointing_policy: module classes, dotted class paths or a ``(module) -> bool`` callable.
        compile: ``True`` or a dict of ``torch.compile`` arguments compiles the wrapped root module in place once it
            is sharded (``nn.Module.compile``: dynamo traces through every FSDP unit's hooks; needs
            ``use_orig_params=True`` on FSDP1); ``hpu_backend`` on Gaudi, ``aot_eager`` on CPU unless ``backend`` is
            given.
        eager_pipeline: sets ``PT_HPU_EAGER_PIPELINE_ENABLE`` for launched processes; ``False`` is Intel's
            documented switch for FSDP stability problems. ``None`` leaves the environment alone.
        process_group_backend: default ``"hccl"`` on Gaudi and ``"gloo"`` on CPU; only ``"hccl"`` works on Gaudi.
        timeout: collective timeout, a ``timedelta`` or seconds.
        fsdp_version: ``1`` (default) shards with torch's ``FullyShardedDataParallel`` (flat parameters);
            ``2`` with ``fully_shard`` (one DTensor per parameter). The same arguments apply to both; a value that
            has no FSDP2 meaning is refused here with what FSDP2 does instead (docs/arguments.md, "The FSDP2 engine").
        check_free_space: before each save, compare the bytes every rank is about to write with the free space of
            its file system and refuse the save before anything is written when it is short. ``None`` (default)
            reads ``LIGHTNING_GAUDI_FSDP_CHECK_FREE_SPACE`` (``0`` turns it off), else on; ``False`` is for file
            systems that report free space wrongly.
        checkpoint_crc32: deprecated (a ``LightningDeprecationWarning`` when ``True``): the checksums of
            ``verify_checkpoints`` supersede it. ``True`` still writes a CRC32 of each record into the checkpoint's zip
            archives, as ``torch.save`` does by default, for zip tools (``unzip -t``, ``zipfile.testzip``); no load
            reads them, and a streamed full save then sends every piece through rank 0. ``False`` (default) leaves
            them out.
        verify_checkpoints: ``True`` (default): every save records an XXH3 checksum of every file it writes
            (computed while writing), and every load of a checkpoint that carries them verifies them before any
            weight changes (:class:`~lightning_gaudi_fsdp.checkpoint.integrity.CheckpointIntegrityError` on every
            rank otherwise). ``False`` neither records nor verifies them.
        failure_timeout: seconds (default 60) any rank waits for others outside a collective before it leaves with
            exit code 1 and a message naming itself and what it waited for: the rendezvous (a rank or the store's
            host lost before or while the process group forms), and the rendezvous store lost during ``fit``.
            ``None`` reads ``LIGHTNING_GAUDI_FSDP_FAILURE_TIMEOUT``, else 60. Raise it where ranks start far apart
            (a large job whose nodes come up over minutes). ``timeout`` still bounds each collective.
        stuck_timeout: seconds a rank may wait in one collective (its Python thread inside ``torch.distributed``)
            before the job is ended as stuck: the rank that never reached the collective prints its Python stack
            once and every rank exits with code 1, the waiting ones naming the stuck rank (node, process id) and
            the collective they waited in. ``None`` (default): off, and ``timeout`` alone bounds a collective.
            Set it above your longest legitimate wait (a slow rank's save, an uneven validation).
        preemption: what a SIGTERM to any rank does during ``fit`` (Kubernetes, SLURM and torchrun end a job with
            it, then SIGKILL). ``"save"`` (default): every rank learns of it within a step without a collective,
            finishes the step in flight, saves that step in ``state_dict_type``'s format to where
            ``Trainer.fit(ckpt_path="last")`` finds it (the ``ModelCheckpoint``'s ``last.ckpt`` whatever its
            ``save_last``, else ``<default_root_dir>/checkpoints/last.ckpt``; an asynchronous save in flight is
            finished first), and leaves with exit code 75, each rank printing one line with the signal, the step and
            the path. Before training starts (setup, sanity check, restore) there is nothing to save and every rank
            leaves at once with the same code. ``"exit"``: Lightning's own handling (no checkpoint). See
            docs/launching.md, "Preemption".
        preemption_grace: seconds (default 25, above 1) from the signal until every rank has left: a save not
            finished one second before it ends is abandoned (nothing partial is visible, the previous ``last.ckpt``
            stays) and every rank leaves, saying so. Keep it below the launcher's kill delay (Kubernetes'
            ``terminationGracePeriodSeconds``, SLURM's ``KillWait``, both 30 s by default).
        async_save: ``True`` makes saves during ``fit`` return once the state is staged into host buffers (kept
            from one save to the next); a background thread writes and commits it while training goes on, in any
            ``state_dict_type``. Parameters and optimizer state in host memory are copied by that thread during the
            next forward and backward; the optimizer step waits for the copy, and an in-place write to them before
            it fails that save. At most one save is in flight: the next one waits for it. An older checkpoint that
            ``ModelCheckpoint`` rotates out is removed only after the newer one committed. A background save that
            fails raises ``CheckpointSaveError`` on every rank at the next save or at the end of fit. Saves outside
            ``fit`` (or after it) stay synchronous. See docs/checkpoints.md, "Saving in the background".
        pretrained_weights: start from these weights: a Hugging Face model directory (``model.safetensors``, or
            several files with ``model.safetensors.index.json``), one ``.safetensors`` file, or a checkpoint of
            this strategy (full, sharded or local; its model weights only: step 0, fresh optimizer). The model built
            in ``configure_model`` gets its parameters on the meta device, and after wrapping each rank reads only
            the slices of its own shards (every stage: fit, validate, test, predict; ``ckpt_path`` still overrides
            them). A parameter the file does not cover, or a file key that fits no parameter, fails before training
            with the keys named; PEFT adapters are initialised as PEFT does. See docs/fine-tuning.md.
        pretrained_prefix: prepended to every file key to name the module parameter it fills (e.g. ``"model."``
            when the LightningModule holds the Hugging Face model as ``self.model``).
    """

    strategy_name = "gaudi_fsdp"

    @_config.takes_arguments()  # every FSDP argument: keyword-only, typed, defaults as in _config.resolve
    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **arguments: Any,
    ) -> None:
        resolved = _config.resolve(**arguments)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            **resolved.parent,
        )
        _config.adopt(self, resolved, self.kwargs)
        self._background = _checkpoints.background_saver(resolved.async_save, resolved.timeout)
        self._pending_stream: FullStream | None = None  # the full checkpoint being built, streamed (see below)
        self._fsdp_root: Module | None = None
        self._cache_off_in_training: list[str] = []  # transformers models whose KV cache is off in training
        self._heartbeat: _liveness.Heartbeat | None = None
        self._resumed_loader_states: list[dict[str, Any]] | None = None  # set by a restore for fit, until it trains

    # ------------------------------------------------------------------------------------------- devices, backend
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        _resume.install(self)  # fit(ckpt_path="last") finds a preempted run's checkpoint in its logger's version

    @override
    def teardown(self) -> None:
        try:
            _checkpoints.finish_trainer_saves(self)
        finally:
            _platform.stop_heartbeat(self)
            _preemption.stop(self)  # a rank told of a SIGTERM leaves here
            super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._heartbeat is not None:
            self._heartbeat.report(exception)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """On ``hccl`` a mean (``self.log(sync_dist=True)``, ``strategy.reduce``) is a sum divided by the group's
        size: HCCL has no AVG."""
        return _platform.reduce_on_hccl(tensor, group, reduce_op, self.process_group_backend, super().reduce)

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
        precision_plugin = precision.adopt(precision_plugin, FSDPPrecision, GaudiFSDPPrecision)
        self._precision_plugin = precision_plugin

    # -------------------------------------------------------------------------------------------------- wrapping
    def _fsdp_device(self) -> torch.device:
        return _sharding.fsdp_device(self)

    @override
    def _setup_model(self, model: Module) -> Module:
        previous = self._fsdp_root
        if previous is None:  # the first model this strategy sets up
            _sharding.warn_if_precision_overlaps(self)
        model = self._engine.set_up(self, model, super()._setup_model)  # records the root in self._fsdp_root
        if self._config.compile_kwargs is not None and self._fsdp_root is not previous:
            _sharding.compile_root(self, model)
        self.precision_plugin.attach(model, self._engine)
        return model

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # For `wrap()` calls inside configure_model: each makes a unit of the engine in use, with the arguments of the
        # automatic wrapping.
        with self._engine.wrap_context(self), _sharding.init_context(self):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._resumed_loader_states = None  # a restore for this fit (it follows setup) sets them
        self.precision_plugin.set_device_type(self.root_device.type)
        super().setup(trainer)
        _report.announce(
            self,
            self._wrapped_model(),
            ("Trainer precision", str(self.precision_plugin.precision)),
            show=trainer.state.fn == TrainerFn.FITTING,
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        context = self.precision_plugin.train_step_context
        return self._engine.step(self, "training_step", context, super().training_step, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        context = self.precision_plugin.val_step_context
        return self._engine.step(self, "validation_step", context, super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        context = self.precision_plugin.test_step_context
        return self._engine.step(self, "test_step", context, super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        context = self.precision_plugin.predict_step_context
        return self._engine.step(self, "predict_step", context, super().predict_step, args, kwargs)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # configure_optimizers runs once, inside Lightning's setup (a hook may have side effects); its optimizers
        # are checked afterwards, also when Lightning refused them, so that the cause named is the groups.
        try:
            super().setup_optimizers(trainer)
        except ValueError as err:
            _sharding.refuse_parameter_groups(self, err)
            raise
        _sharding.refuse_parameter_groups(self, None)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._background is not None:
            # The closure runs the forward and backward, inside optimizer.step() and before it writes anything: an
            # asynchronous save's copies are waited for after it, so they overlap the forward and backward.
            closure = functools.partial(_checkpoints.then_wait_for_copies, closure, self)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._config.compile_kwargs is not None:
            # FSDP keeps the sharded gradient on the flat parameter while the next forward unshards its data;
            # dynamo cannot trace a tensor whose .grad has another size. The step consumed the gradients and the
            # next backward would zero them anyway, so drop them now.
            optimizer.zero_grad(set_to_none=True)
        return output

    def _effective_cpu_offload(self, warn: bool = True) -> CPUOffload:
        return _sharding.effective_cpu_offload(self, warn)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _wrapped_model(self) -> Module:
        if self.model is None or self.lightning_module is None:
            raise RuntimeError("GaudiFSDPStrategy: the model is not set up yet; call this inside trainer.fit/validate")
        return self.model

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        model = self._wrapped_model()
        # Kept until save_checkpoint writes it (see _checkpoints.trainer_full_stream); the next checkpoint replaces it.
        self._pending_stream = stream = _checkpoints.trainer_full_stream(self)
        return self._engine.model_state_dict(model, self._config.state_dict_type, self.root_device.type, stream)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        model = self._wrapped_model()
        stream = self._pending_stream if lightning_internals.building_checkpoint_to_save() else None
        return self._engine.optimizer_state_dict(
            model, optimizer, self._config.state_dict_type, self.root_device.type, self.global_rank, stream
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        stream, self._pending_stream = self._pending_stream, None  # taken whatever happens next
        if storage_options is not None:
            raise TypeError("GaudiFSDPStrategy.save_checkpoint does not take storage_options")
        path = _checkpoints.agreed_path(self, filepath, "filepath", "trainer.save_checkpoint")
        optimizers = self.optimizers if "optimizer_states" in checkpoint else ()
        model = self._wrapped_model()
        metadata = _checkpoints.checkpoint_extras(self, model, checkpoint, optimizers)
        _checkpoints.save_checkpoint(self, checkpoint, path, metadata, model, self.optimizers, stream)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        # With async_save, ModelCheckpoint asks to remove the checkpoint it replaces right after save_checkpoint
        # returns, before the newer one is written: that removal waits until the newer one has committed.
        background = self._background
        remove = functools.partial(_checkpoints.remove_checkpoint, self, filepath, super().remove_checkpoint)
        if background is not None and background.active:
            background.defer_removal(remove)
            return
        remove()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._resumed_loader_states is not None:  # the resumed epoch's order, and the position saved in it
            lightning_internals.resume_train_loaders(self.lightning_module.trainer, self._resumed_loader_states)
            self._resumed_loader_states = None
        _preemption.start_training(self)
        if self._background is not None:
            self._background.active = True  # until teardown, which waits for the last save

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Check ``checkpoint_path`` on every rank, then load it. ``weights_only`` is the one given to
        ``Trainer.fit/validate/test/predict(..., weights_only=...)`` (Lightning >= 2.6; see
        :func:`.lightning_internals.fit_weights_only`): ``None`` (torch's default) and ``True`` unpickle every file
        safely, ``False`` without restriction, for a checkpoint whose source is trusted. Lightning 2.5 has no such
        argument: loading is always safe there."""
        model = self._wrapped_model()
        if weights_only is None:
            weights_only = lightning_internals.fit_weights_only(self.lightning_module.trainer)
        path = _checkpoints.trainer_load_path(self, checkpoint_path)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        checkpoint = _checkpoints.load_agreed(
            self,
            path,
            model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only is not False,
            load_optimizers=fitting and bool(self.optimizers),
        )
        if fitting:
            self._resumed_loader_states = lightning_internals.saved_train_loader_states(checkpoint)
        return checkpoint
