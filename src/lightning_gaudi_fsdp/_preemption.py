"""Preemption (``preemption="save"``) at the doors: a SIGTERM to any rank saves the last completed step and every rank
leaves within ``preemption_grace`` seconds with exit code :data:`EXIT_CODE` and one line saying what happened.

What the doors call (:func:`arm` once the process group exists, :func:`start_training`, Fabric's :func:`preempted`
and :func:`after_fabric_save`, :func:`stop` in teardown) and the Trainer's callback that saves at the agreed step.
The watcher each rank runs, and how the ranks agree without a collective per step: :mod:`._preemption_watch`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_gaudi_fsdp import _liveness, _liveness_store
from lightning_gaudi_fsdp._preemption_watch import DEFAULT_GRACE_S, EXIT_CODE, Preemption
from lightning_gaudi_fsdp.adapters import lightning_internals

__all__ = [
    "DEFAULT_GRACE_S",
    "EXIT_CODE",
    "Preemption",
    "after_fabric_save",
    "arm",
    "preempted",
    "start_training",
    "stop",
]

log = logging.getLogger(__name__)


def arm(door: Any) -> None:
    """Once the process group exists (both doors' ``setup_environment``): watch for SIGTERM when
    ``preemption="save"``. Needs the rendezvous store with several ranks; without one (the heartbeat switched off)
    a signalled rank leaves at once, as Lightning's own handling would."""
    if door._config.preemption != "save" or door._preempt is not None:
        return
    store = None
    if door.world_size > 1:
        if not (door._config.heartbeat and _liveness.store_address_known()):
            log.warning(
                "lightning_gaudi_fsdp: preemption='save' needs the rendezvous store (MASTER_ADDR/MASTER_PORT and the "
                f"heartbeat, {_liveness._DISABLE_ENV} not 0); a SIGTERM is left to Lightning"
            )
            return
        store = _liveness_store._connect(timeout_s=30)
    from lightning.pytorch.strategies import Strategy as TrainerStrategy

    fabric = not isinstance(door, TrainerStrategy)  # Fabric: leave through Python's exit path before training
    watcher = Preemption(door._config.preemption_grace, lambda: (door.global_rank, door.world_size), fabric)
    watcher.start(store)
    door._preempt = watcher


def stop(door: Any) -> None:
    """In the door's ``teardown``: see :meth:`Preemption.stop`."""
    watcher, door._preempt = door._preempt, None
    if watcher is not None:
        watcher.stop()


def start_training(door: Any) -> None:
    """The Trainer's ``on_train_start``: step boundaries count from here, at the end of each training batch that
    stepped the optimizers, where :class:`_SaveAtPreemption` (added last to the callbacks) saves."""
    watcher = door._preempt
    if watcher is None:
        return
    trainer = door.lightning_module.trainer
    watcher.take_over()
    saver = next((cb for cb in trainer.callbacks if isinstance(cb, _SaveAtPreemption)), None)
    if saver is None:
        trainer.callbacks.append(_SaveAtPreemption(watcher))
    else:  # a later fit of the same Trainer
        saver.watcher = watcher
    watcher.phase = "training"


def preempted(door: Any) -> bool:
    """Fabric's ``strategy.preempted``: a step boundary (see :meth:`Preemption.boundary`)."""
    watcher = door._preempt
    if watcher is None:
        return False
    watcher.phase = "training"
    return watcher.boundary()


def after_fabric_save(door: Any, path: Path) -> None:
    """After ``fabric.save``: at the save point, wait for the save to commit (in the background too), then leave."""
    watcher = door._preempt
    if watcher is None or watcher.stop_at is None or watcher.boundaries < watcher.stop_at:
        return
    from lightning_gaudi_fsdp import _checkpoints

    watcher.saving = str(path)
    _checkpoints.wait_for_saves(door, f"the preemption checkpoint {str(path)!r}")
    watcher.leave_saved(str(path))


class _SaveAtPreemption(Callback):
    """Last of the Trainer's callbacks: at the save point, save the completed step (``_resume.preemption_path``) and
    leave."""

    def __init__(self, watcher: Preemption) -> None:
        self.watcher = watcher

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if lightning_internals.accumulating(trainer):
            return  # mid-accumulation: the gradients accumulated so far would not be in the checkpoint
        watcher = self.watcher
        if not watcher.boundary(trainer.global_step):
            return
        from lightning_gaudi_fsdp import _checkpoints, _resume

        path = _resume.preemption_path(trainer)
        watcher.saving = path
        for logger in trainer.loggers:  # as Lightning's SLURM requeue does before its save
            with contextlib.suppress(Exception):
                logger.finalize("finished")
        trainer.save_checkpoint(path)
        _checkpoints.wait_for_saves(trainer.strategy, f"the preemption checkpoint {path!r}")
        watcher.leave_saved(path)
