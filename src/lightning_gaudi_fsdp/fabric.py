"""``GaudiFSDPStrategy`` for Lightning Fabric: the same FSDP on Intel Gaudi (or CPU processes over gloo) as the
Trainer's strategy, with the same arguments, engines and checkpoints.

The Trainer's strategy (:mod:`lightning_gaudi_fsdp.strategy`) and this one are two thin doors onto :mod:`._config`
(argument resolution), :mod:`._platform` (Gaudi runtime), :mod:`._sharding` (wrapping with either engine),
:mod:`._checkpoints` (checked loading), :mod:`.precision` and :mod:`.checkpoint`; here are only Fabric's hooks.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning
import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
from lightning.fabric.strategies import FSDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gaudi_fsdp import _checkpoints, _config, _platform, _preemption, _report, _sharding, precision
from lightning_gaudi_fsdp.adapters import lightning_internals
from lightning_gaudi_fsdp.adapters.lightning_internals import BackwardSyncControl, Stateful
from lightning_gaudi_fsdp.checkpoint import loading, views
from lightning_gaudi_fsdp.engine import pieces
from lightning_gaudi_fsdp.precision import GaudiFabricFSDPPrecision

if TYPE_CHECKING:
    from lightning_gaudi_fsdp.adapters.lightning_internals import PATH as _PATH

FABRIC_KEYS = views.FABRIC_KEYS  # which entries of Fabric's `state` went where in the checkpoint


class GaudiFSDPStrategy(_platform.GaudiPlatform, FSDPStrategy):
    r"""Fully Sharded Data Parallel on Intel Gaudi for Lightning Fabric, rehearsable on CPU processes over gloo.

    Takes, as keyword arguments, those of the Trainer's :class:`lightning_gaudi_fsdp.GaudiFSDPStrategy` (see there
    for each: ``sharding_strategy``, ``auto_wrap_policy``, ``state_dict_type``, ``fsdp_version``...), from the same
    definition, resolved and checked by the same code before any process starts; ``precision`` in place of
    ``precision_plugin`` and no ``checkpoint_io`` (FSDP checkpoints do not go through a ``CheckpointIO``). The
    defaults are the Trainer's but one, as with Lightning's own two FSDP strategies: ``state_dict_type="sharded"``
    (each rank writes its own shards, as Lightning's Fabric ``FSDPStrategy`` does by default); pass
    ``state_dict_type="full"`` for one file that ``torch.load(path)["model"]`` reads.
    ``fsdp_version`` picks the engine (1: ``FullyShardedDataParallel``, 2: ``fully_shard``). With
    ``pretrained_weights``, a model built under ``fabric.init_module()`` gets its parameters on the meta device and
    ``setup_module`` fills each rank's shards from the file.

    ``fabric.save(path, state)`` writes Lightning Fabric's layout in the ``state_dict_type`` format: each entry of
    ``state`` under its own key (the model as its full state dict, an optimizer as its state keyed by parameter name,
    as Lightning's Fabric ``FSDPStrategy`` writes them; anything else as given, or its ``state_dict()``), so
    ``torch.load(path)["model"]`` loads into the plain model; the package's bookkeeping (engine, Hugging Face record)
    goes under the key ``"gaudi_fsdp"``, which ``state`` may not use. A sharded checkpoint keeps the model and
    optimizers in the DCP files under their keys of ``state``, the rest in ``meta.pt``, as Lightning's Fabric does.
    ``filter={"model": lambda name, value: ...}`` keeps only the entries a function accepts
    (``state_dict_type="full"`` only). ``fabric.load(path, state)`` reads this layout, the Trainer's and that of
    Lightning's own Fabric ``FSDPStrategy`` (format detected on disk), checks it on every rank before any weight
    changes, restores the model, the optimizers and every object with ``load_state_dict`` (schedulers...) in place,
    puts plain values back into ``state`` and returns the checkpoint's other entries (never the bookkeeping). The
    Trainer resumes from a checkpoint saved here. ``fabric.load_raw(path, obj)`` loads a model (set up or not) or an
    optimizer from any checkpoint of either door or from a plain ``torch.save`` of a state dict.

    ``async_save=True``: ``fabric.save`` returns once the state is staged into host buffers; a background thread
    writes and commits it while the loop goes on (any format; at most one save in flight). Parameters and optimizer
    state in host memory are copied by that thread while the loop goes on; ``optimizer.step()`` waits for the copy.
    Fabric has no end-of-run hook, so the save in flight is waited for by the next ``fabric.save``, by
    ``fabric.load``/``load_raw``, by ``fabric.strategy.teardown()`` (each raises a failed background save on every
    rank as ``CheckpointSaveError``), and, as a last resort, when the interpreter exits (``atexit``; a failure there
    is logged, not raised, and ``os._exit`` skips it).

    ``preemption="save"`` (default): a loop that reads ``fabric.strategy.preempted`` once per step saves and leaves
    when any rank receives SIGTERM::

        if fabric.strategy.preempted:  # the same answer on every rank, at the same step
            fabric.save(path, state)  # commits (a background save too), then every rank leaves with exit code 75

    A SIGTERM before the first read (setup) ends every rank at once (nothing to save), and every rank leaves within
    ``preemption_grace`` seconds whatever happens (docs/launching.md, "Preemption").
    """

    strategy_name = "gaudi_fsdp"

    # Every FSDP argument, keyword-only and typed, from the same definition as the Trainer's strategy
    # (_config.resolve); Lightning's Fabric FSDPStrategy saves sharded checkpoints by default, and so does this one.
    @_config.takes_arguments(state_dict_type="sharded")
    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        **arguments: Any,
    ) -> None:
        resolved = _config.resolve(**arguments)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
            **resolved.parent,
        )
        _config.adopt(self, resolved, self._fsdp_kwargs)
        self._backward_sync_control = _NoSync(self._engine)
        self._background = _checkpoints.background_saver(resolved.async_save, resolved.timeout)
        if self._background is not None:
            self._background.active = True  # every fabric.save, until teardown
        self._waits_at_exit = False
        self._models: weakref.WeakSet[Module] = weakref.WeakSet()  # every model set up, for load_raw(optimizer)

    @property
    def preempted(self) -> bool:
        """Read once per step, at the same point of the loop on every rank: ``True`` on every rank at the same
        step once any rank received SIGTERM (``preemption="save"``); the next ``fabric.save`` then commits and the
        process leaves with exit code 75. Costs two attribute reads until a signal comes."""
        return _preemption.preempted(self)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The FSDP keyword arguments (the Trainer's strategy calls them ``kwargs``)."""
        return self._fsdp_kwargs

    # ---------------------------------------------------------------------------------------------------- precision
    @property
    @override
    def precision(self) -> GaudiFabricFSDPPrecision:
        plugin = self._precision
        if plugin is None:
            plugin = self._precision = GaudiFabricFSDPPrecision("32-true")
        return plugin  # type: ignore[return-value]

    @precision.setter
    @override
    def precision(self, plugin: Precision | None) -> None:
        self._precision = precision.adopt(plugin, FSDPPrecision, GaudiFabricFSDPPrecision)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.precision.set_device_type(self.root_device.type)

    @override
    def teardown(self) -> None:
        """Wait for the background save in flight (raising its failure on every rank), stop the heartbeat."""
        try:
            if self._background is not None:
                gather = functools.partial(pieces.gather_objects, world_size=self.world_size)
                self._background.finish(rank=self.global_rank, gather=gather)
        finally:
            _platform.stop_heartbeat(self)
            _preemption.stop(self)  # a rank told of a SIGTERM leaves here
            # Lightning's Strategy.teardown, less checkpoint_io.teardown(): its Fabric FSDPStrategy raises
            # NotImplementedError from the checkpoint_io property, so the inherited teardown cannot run.
            self.cluster_environment.teardown()  # type: ignore[union-attr]
            self.precision.teardown()
            if self.accelerator is not None:
                self.accelerator.teardown()

    # ----------------------------------------------------------------------------------------------------- modules
    @override
    def setup_module(self, module: Module) -> Module:

        engine = self._engine
        module = engine.set_up(self, module, super().setup_module)
        if self._config.compile_kwargs is not None:
            _sharding.compile_root(self, module)
        self.precision.attach(module, engine)
        _report.announce(self, module, ("Fabric precision", str(self.precision.precision)))
        self._models.add(module)
        return module

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        self._engine.refuse_optimizers_made_before(optimizers)
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(self._engine.wrap_context(self))
        stack.enter_context(_sharding.init_context(self))
        return stack

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm over every shard on every rank, on either engine."""
        self.precision.unscale_gradients(optimizer)
        return _sharding.clip_grad_norm(self._engine, module, max_norm, norm_type)

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return _platform.reduce_on_hccl(tensor, group, reduce_op, self.process_group_backend, super().all_reduce)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        _checkpoints.wait_for_copies(self)  # an asynchronous save copies what the step writes after fabric.save
        return super().optimizer_step(optimizer, **kwargs)

    # ------------------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write ``state`` to ``path`` in ``state_dict_type``'s format (see the class docstring)."""
        if storage_options is not None:
            raise TypeError("GaudiFSDPStrategy.save_checkpoint does not take storage_options")
        fmt = self._config.state_dict_type
        _check_filter(filter, state, fmt)
        clash = [key for key in state if key in views.reserved_keys()]
        if clash:
            raise ValueError(
                f"state keys {clash} are reserved for the checkpoint's bookkeeping; rename them (reserved: "
                f"{list(views.reserved_keys())})"
            )
        device_type = self.root_device.type
        path = _checkpoints.agreed_path(self, path, "path", "fabric.save")
        model_key, model = _find_model(state, self._engine)
        optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
        keep = _filtered(filter or {})
        # Streamed (each tensor received on rank 0 as it is written) unless a filter reads the state first.
        stream = _checkpoints.full_stream(self) if filter is None else None
        others = {
            key: keep(key, obj.state_dict() if isinstance(obj, Stateful) else obj)
            for key, obj in state.items()
            if key != model_key and key not in optimizers
        }
        schedulers = [key for key, obj in state.items() if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)]
        checkpoint: dict[str, Any] = {
            "state_dict": keep(model_key, self._engine.model_state_dict(model, fmt, device_type, stream)),
            "optimizer_states": [
                keep(key, self._engine.optimizer_state_dict(model, opt, fmt, device_type, self.global_rank, stream))
                for key, opt in optimizers.items()
            ],
            views.VERSION_KEY: lightning.__version__,
            **others,
            FABRIC_KEYS: {"model": model_key, "optimizers": list(optimizers), "schedulers": schedulers},
        }
        metadata = _checkpoints.checkpoint_extras(self, model, checkpoint, list(optimizers.values()))
        checkpoint = views.fabric_layout(checkpoint)
        if self._background is not None and not self._waits_at_exit:
            atexit.register(self._wait_at_exit)
            self._waits_at_exit = True
        _checkpoints.save_checkpoint(self, checkpoint, path, metadata, model, list(optimizers.values()), stream)
        _preemption.after_fabric_save(self, path)  # at the preemption's save point: commit, then leave

    def _wait_at_exit(self) -> None:
        # The process is ending and its peers may be gone: no agreement over the main group, a bounded wait.
        if self._background is not None and self._background.active:
            self._background.finish(rank=self.global_rank, gather=lambda obj: [obj], interrupted=True)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from ``path`` (any format, written by this strategy in Fabric or in the Trainer).

        ``state`` holds the model (set up by Fabric), optionally its optimizers and any other entries; a bare model
        loads its weights only. ``strict``: the model's keys must match the checkpoint's and every requested entry
        must be in it (``KeyError`` otherwise), as Fabric documents. Returns what the checkpoint holds beyond
        ``state``. ``weights_only=False`` unpickles without restriction (a trusted checkpoint only)."""
        if not state:
            raise ValueError(
                "GaudiFSDPStrategy.load_checkpoint needs a state with the model to load into, e.g. "
                "fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        path = _checkpoints.agreed_path(self, path, "path", "fabric.load")
        _checkpoints.wait_for_saves(self, f"loading {str(path)!r}")
        safe = weights_only is not False
        if isinstance(state, Module | Optimizer):
            self._load_raw(path, state, strict, safe)
            return {}
        model_key, model = _find_model(state, self._engine)
        optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
        rest = _checkpoints.load_agreed(
            self,
            path,
            model,
            list(optimizers.values()),
            strict=strict,
            weights_only=safe,
            load_optimizers=bool(optimizers),
            hints=(model_key, list(optimizers)),
        )
        return _restore_entries(state, rest, model_key, optimizers, strict)

    def _load_raw(self, path: Path, obj: Module | Optimizer, strict: bool, weights_only: bool) -> None:
        """``fabric.load_raw``: a model set up by this strategy loads any checkpoint (its format from disk) or a
        plain state-dict file, checked on every rank first; a model not set up loads the full state of any of them;
        an optimizer loads from a single file (see :func:`.loading.read_full_optimizer_state`)."""
        if isinstance(obj, Module):
            if self._engine.owns(obj):
                _checkpoints.load_agreed(
                    self, path, obj, [], strict=strict, weights_only=weights_only, load_optimizers=False, raw=True
                )
            else:
                obj.load_state_dict(loading.read_full_model_state(path, weights_only=weights_only), strict=strict)
            return
        state = _checkpoints.agreed(
            self, path, lambda: loading.read_full_optimizer_state(path, weights_only=weights_only)
        )
        held = {id(p) for group in obj.param_groups for p in group["params"]}
        owner = next((m for m in self._models if held <= {id(p) for p in m.parameters()}), None)
        if owner is not None:  # an optimizer of a sharded model: the full state is sharded as it loads
            self._engine.load_full_optimizer(owner, obj, state, self.root_device.type)
        else:
            obj.load_state_dict(state)


def _check_filter(filter: Any, state: dict[str, Any], fmt: str) -> None:
    """``fabric.save(..., filter=...)``: a dict from keys of ``state`` to ``(name, value) -> bool`` functions, on
    full checkpoints only (a sharded or local checkpoint must hold every shard to load)."""
    if filter is None:
        return
    if fmt != "full":
        raise ValueError(
            f"fabric.save(filter=...) needs state_dict_type='full'; this strategy writes {fmt!r} checkpoints, which "
            "must hold every shard to load (accepted: a filter with 'full', or no filter)"
        )
    if not isinstance(filter, dict):
        raise TypeError(f"filter must be a dict from state keys to (name, value) -> bool functions, got {filter!r}")
    for key, fn in filter.items():
        if key not in state:
            raise ValueError(f"filter key {key!r} is not in the state; expected one of {sorted(state)}")
        if not callable(fn):
            raise TypeError(f"filter[{key!r}] must be a (name, value) -> bool function, got {fn!r}")


def _filtered(filter: dict[str, Callable[[str, Any], bool]]) -> Callable[[str, Any], Any]:
    """``keep(key, state)``: ``state`` with only the entries ``filter[key]`` accepts (as Fabric filters: a state
    that is not a dict, or a key without a filter, is kept whole)."""

    def keep(key: str, value: Any) -> Any:
        fn = filter.get(key)
        if fn is None or not isinstance(value, dict):
            return value
        return {name: item for name, item in value.items() if fn(name, item)}

    return keep


def _find_model(state: dict[str, Any], engine: Any) -> tuple[str, Module]:
    found = [(key, obj) for key, obj in state.items() if isinstance(obj, Module) and engine.owns(obj)]
    if len(found) != 1:
        raise ValueError(
            f"the state must hold exactly one model set up by Fabric (found {len(found)}); save and load each model "
            "separately, e.g. fabric.save(path, {'model': model, 'optimizer': optimizer})"
        )
    return found[0]


def _restore_entries(
    state: dict[str, Any], rest: dict[str, Any], model_key: str, optimizers: dict[str, Optimizer], strict: bool
) -> dict[str, Any]:
    """Everything in ``state`` besides the model and optimizers, from the checkpoint's ``rest`` (the internal view,
    see :mod:`.checkpoint.views`): objects with ``load_state_dict`` in place, plain values replaced. A Trainer
    checkpoint has no entry per scheduler: schedulers then come from its ``lr_schedulers`` in order. Returns the
    entries not requested, without any of the package's bookkeeping."""
    keys = rest.get(FABRIC_KEYS)
    trainer_schedulers = rest.get("lr_schedulers", [])
    for key in views.INTERNAL_KEYS:
        rest.pop(key, None)
    requested = [key for key in state if key != model_key and key not in optimizers]
    if keys is None:
        saved_schedulers = iter(trainer_schedulers)
        for key in requested:
            if key not in rest and isinstance(state[key], torch.optim.lr_scheduler.LRScheduler):
                rest[key] = next(saved_schedulers, None)
                if rest[key] is None:
                    del rest[key]
    lightning_internals.validate_keys_for_strict_loading(requested, rest.keys(), strict=strict)
    for key in requested:
        if key not in rest:
            continue
        obj = state[key]
        if isinstance(obj, Stateful):
            obj.load_state_dict(rest.pop(key))
        else:
            state[key] = rest.pop(key)
    return rest


class _NoSync(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients stay local to each rank until the next synchronised backward,
    on either engine."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._engine.no_sync(module) if enabled else nullcontext()
