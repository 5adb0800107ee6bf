"""Lightning internals, read in one place: private helpers the doors reuse, and two facts only Lightning's call stack
holds (whether a checkpoint being built goes straight to ``Strategy.save_checkpoint``, and the ``weights_only`` given to
the running ``Trainer.fit``).

The call-stack facts fail safe (no streaming; safe loading) when Lightning moves the code they look for;
``tests/test_adapters.py`` checks every name used here, so a Lightning release that moves one fails there instead of
silently switching a feature off.

The doors may still set and read the attributes of the Lightning ``FSDPStrategy`` they subclass (``_precision_plugin``,
``_backward_sync_control``, ``_timeout``, ``_fsdp_kwargs``...): that is Lightning's own subclassing contract.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _PATH, _Stateful

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.nn import Module

PATH = _PATH  # what Lightning's checkpoint methods accept as a path
Stateful = _Stateful  # the protocol of objects with state_dict/load_state_dict
BackwardSyncControl = _BackwardSyncControl  # base of a Fabric strategy's no_backward_sync
validate_keys_for_strict_loading = _validate_keys_for_strict_loading


def move_torchmetrics_to_device(module: Module, device: Any) -> None:
    """Move the torchmetrics metrics inside ``module`` to ``device``, as Lightning's FSDP strategies do after wrapping
    (FSDP does not move them: they hold no parameters)."""
    from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device

    _move_torchmetrics_to_device(module, device)


def redirect_forward(strategy: Any, module: Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``module.<method>(*args, **kwargs)`` inside ``module``'s forward, with Lightning's forward redirection (the
    strategy's, which Lightning's ``FSDPStrategy`` builds)."""
    return strategy._forward_redirection(module, module, method, *args, **kwargs)


def attached_trainer(module: Any) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or None (``LightningModule.trainer`` raises when there is none)."""
    return module._trainer if module is not None else None


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether the batch just run is mid gradient accumulation (the optimizer has not stepped after it)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def stage_throughputs(monitor: Any) -> list[Any]:
    """The ``Throughput`` per stage that Lightning's ``ThroughputMonitor.setup`` built (Lightning >= 2.1)."""
    return list(monitor._throughputs.values())


def building_checkpoint_to_save() -> bool:
    """Whether the caller runs inside Lightning's ``dump_checkpoint`` called by ``Trainer.save_checkpoint``, which
    hands the checkpoint straight to ``Strategy.save_checkpoint``: no user code holds it in between."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    dump, save = _CheckpointConnector.dump_checkpoint.__code__, Trainer.save_checkpoint.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not dump:
        frame = frame.f_back
    return frame is not None and frame.f_back is not None and frame.f_back.f_code is save


def fit_weights_only(trainer: pl.Trainer | None) -> bool | None:
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


def resolve_fit_ckpt_path(strategy: Any, resolve: Any) -> None:
    """Have the strategy's launcher (in every process, before Lightning selects the checkpoint: ``Trainer._fit_impl``
    calls ``_select_ckpt_path`` first) pass the ``ckpt_path`` given to ``Trainer.fit`` through ``resolve(trainer,
    ckpt_path)``, whose answer Lightning then reads as it would the user's. Where processes are created externally
    (torchrun, SLURM) Lightning's ``FSDPStrategy`` has no launcher: one that runs the function in place does it."""
    from lightning.pytorch.strategies.launchers.launcher import _Launcher

    class _InPlace(_Launcher):
        @property
        def is_interactive_compatible(self) -> bool:
            return True

        def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        def kill(self, signum: Any) -> None:
            pass  # no process of its own

    if strategy._launcher is None:
        strategy._launcher = _InPlace()
    launcher = strategy._launcher
    real = launcher.launch

    def launch(function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if getattr(function, "__name__", "") == "_fit_impl" and trainer is not None:
            bound = inspect.signature(function).bind(*args, **kwargs)
            bound.arguments["ckpt_path"] = resolve(trainer, bound.arguments.get("ckpt_path"))
            args, kwargs = bound.args, bound.kwargs
        return real(function, *args, trainer=trainer, **kwargs)

    launcher.launch = launch


def hpc_save_path(folder: str) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in ``folder``: where Lightning's own SLURM requeue saves."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    return _CheckpointConnector.hpc_save_path(folder)


def hpc_resume_path(trainer: pl.Trainer) -> str | None:
    """The newest ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``: what Lightning restores by itself under SLURM when
    ``fit`` is given no ``ckpt_path``."""
    return trainer._checkpoint_connector._hpc_resume_path


def last_checkpoints(callback: Any, trainer: pl.Trainer) -> set[str]:
    """The ``last*.ckpt`` that ``fit(ckpt_path="last")`` considers in this ``ModelCheckpoint``'s folder."""
    return callback._find_last_checkpoints(trainer)


def chained_sigterm_handlers(handler: Any) -> list[Any] | None:
    """The handlers inside Lightning's SIGTERM handler (``_SignalConnector.register_signal_handlers`` composes its own
    with the one it found), less Lightning's own; None if ``handler`` is not Lightning's."""
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

    if not isinstance(handler, _HandlersCompose):
        return None
    return [h for h in handler.signal_handlers if not isinstance(getattr(h, "__self__", None), _SignalConnector)]


def saved_train_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The saved positions of the training dataloaders that have ``state_dict`` (as torchdata's
    ``StatefulDataLoader``) in a Trainer checkpoint: the fit loop's ``combined_loader`` entry (Lightning >= 2.0);
    an empty list where there is none."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return list(fit_loop.get("state_dict", {}).get("combined_loader", []))


def resume_train_loaders(trainer: pl.Trainer, states: list[dict[str, Any]]) -> None:
    """After a restore, point the training dataloaders at the epoch the fit loop resumes and at the saved position in
    it; call it between the fit loop's ``reset`` and its first epoch (the ``on_train_start`` hooks run there).

    Lightning's ``FitLoop.setup_data`` applies the saved positions and calls ``iter()`` on the loaders before
    ``FitLoop.on_advance_start`` sets the samplers' epoch (``_set_sampler_epoch``) and before ``FitLoop.reset`` decides
    which epoch the run resumes (the next one where the checkpoint followed an epoch's last batch). A loader that draws
    its sampler's order in ``iter()``, as ``StatefulDataLoader`` does (its ``BatchSampler`` iterator calls
    ``iter(sampler)`` at once), so replays the order of the sampler's epoch at that time (0 for a new sampler) in
    whatever epoch the run resumes; and a position saved after an epoch's last batch makes the resumed epoch an empty
    one, so that the run skips an epoch. Here every sampler gets the resumed epoch first, the saved position is applied
    only where it lies inside that epoch (the checkpoint did not follow the epoch's last batch), and the loop's data
    fetcher makes its iterator again, as Lightning does at the start of every later epoch."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    fit_loop = trainer.fit_loop
    combined, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
    if combined is None or fetcher is None:
        return
    for loader in combined.flattened:
        _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
    if states and fit_loop.restarting and not fit_loop.epoch_loop.batch_progress.is_last_batch:
        combined._load_state_dicts(states)
    iter(fetcher)
