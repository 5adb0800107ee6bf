"""Where the Trainer's preemption save goes, and how the requeued run of the same command finds it.

The save goes where Lightning's conventions put a run's last checkpoint: the first ``ModelCheckpoint``'s
``last.ckpt`` (with Lightning's default logger, ``<default_root_dir>/lightning_logs/version_N/checkpoints``), or under
SLURM Lightning's own requeue checkpoint, ``<default_root_dir>/hpc_ckpt_<n>.ckpt``, which Lightning restores by itself
when ``fit`` is given no ``ckpt_path`` on a SLURM node.

A logger gives each run a new version, hence a new checkpoint folder, and ``fit(ckpt_path="last")`` looks only in the
new one: the requeued run would find nothing and start over. So with ``preemption="save"``, ``ckpt_path="last"`` takes
the newest last checkpoint of Lightning's own candidates, of the same logger's earlier versions (the folders the same
``ModelCheckpoint`` saved to in earlier runs) and, under SLURM, of the requeue checkpoints: what it already means with
``logger=False``, where every run shares one folder. Where Lightning's own candidate is the newest, nothing changes.

Before that, in the launching process (before any other process starts) and in every process that torchrun or SLURM
started, :func:`refuse_urls` checks a ``ckpt_path`` and each checkpoint folder: a location that cannot be honoured is
refused, and at a URL (object storage) the bucket must exist and the credentials be accepted, before anything is
trained, read or written (see :mod:`.checkpoint.files`). ``ckpt_path="last"`` with a ``ModelCheckpoint`` whose folder
is a URL takes the newest committed ``last*.ckpt`` there (:func:`last_at_urls`): Lightning's own search lists the
bucket's keys without their protocol and finds none.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gaudi_fsdp.adapters import lightning_internals
from lightning_gaudi_fsdp.checkpoint import commit, files


def install(strategy: Any) -> None:
    """In the Trainer door's ``_configure_launcher``: check and resolve ``fit(ckpt_path=...)`` as described above."""
    lightning_internals.resolve_fit_ckpt_path(strategy, _checked_and_resolved)


def _checked_and_resolved(trainer: Any, ckpt_path: Any) -> Any:
    refuse_urls(trainer, ckpt_path)
    return resolve_last(trainer, ckpt_path)


def refuse_urls(trainer: Any, ckpt_path: Any) -> None:
    """Raise :class:`~.location.CheckpointURLError` if ``fit``'s ``ckpt_path`` or a folder this fit saves checkpoints
    to is a URL: a checkpoint callback's ``dirpath``, else the logger's ``save_dir`` or the Trainer's
    ``default_root_dir`` it saves under, and where the preemption save goes."""
    places = [("trainer.fit", "ckpt_path", ckpt_path)] if isinstance(ckpt_path, str | os.PathLike) else []
    root = ("Trainer", "default_root_dir", trainer.default_root_dir)
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is not None:
            places.append((type(callback).__name__, "dirpath", dirpath))
        elif trainer.loggers and trainer.loggers[0].save_dir is not None:
            places.append((type(trainer.loggers[0]).__name__, "save_dir", trainer.loggers[0].save_dir))
        else:
            places.append(root)
    config = getattr(trainer.strategy, "_config", None)
    if config is not None and config.preemption == "save" and (not trainer.checkpoint_callbacks or on_slurm(trainer)):
        places.append(root)  # <default_root_dir>/checkpoints/last.ckpt, or SLURM's hpc_ckpt_<n>.ckpt
    for call, argument, value in places:
        where = files.locate(value, argument, call)
        if files.is_remote(where):
            files.probe(where, argument, call)


def on_slurm(trainer: Any) -> bool:
    return isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)


def preemption_path(trainer: Any) -> str:
    """Where the preemption save goes (every rank calls this at the save point: the SLURM name is rank 0's)."""
    if on_slurm(trainer):
        return trainer.strategy.broadcast(lightning_internals.hpc_save_path(str(trainer.default_root_dir)))
    return str(last_checkpoint_path(trainer))


def last_checkpoint_path(trainer: Any) -> files.Where:
    """The first ``ModelCheckpoint``'s ``last.ckpt`` (whatever its ``save_last``), else
    ``<default_root_dir>/checkpoints/last.ckpt``."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath is not None:
        folder = files.locate(callback.dirpath, "dirpath", type(callback).__name__)
        return folder / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return files.locate(trainer.default_root_dir, "default_root_dir", "Trainer") / "checkpoints" / "last.ckpt"


def last_at_urls(trainer: Any) -> str | None:
    """The newest committed ``last*.ckpt`` in the URL folders of the ``ModelCheckpoint`` callbacks (by the time in
    its commit record), or None."""
    found: dict[str, float] = {}
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if not isinstance(callback, ModelCheckpoint) or dirpath is None:
            continue
        folder = files.locate(dirpath, "dirpath", type(callback).__name__)
        if not files.is_remote(folder):
            continue
        last, extension = re.escape(callback.CHECKPOINT_NAME_LAST), re.escape(callback.FILE_EXTENSION)
        pattern = re.compile(rf"^{last}(-\d+)?{extension}$")
        for name in files.listdir(folder):
            record = commit.read_record(folder / name) if pattern.match(name) else None
            if record is not None:
                found[str(folder / name)] = float(record.get("time", 0.0))
    return max(found, key=found.__getitem__) if found else None


def resolve_last(trainer: Any, ckpt_path: Any) -> Any:
    """``ckpt_path`` as given to ``fit``, or the path of the newest last checkpoint where Lightning would miss it."""
    if ckpt_path == "last":
        at_url = last_at_urls(trainer)
        if at_url is not None:
            return at_url
    if ckpt_path != "last" or getattr(trainer.strategy, "_config", None) is None:
        return ckpt_path
    if trainer.strategy._config.preemption != "save":
        return ckpt_path
    own = {getattr(cb, "ckpt_path", None) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            own |= lightning_internals.last_checkpoints(callback, trainer)
    own.discard(None)
    extra = _earlier_versions(trainer)
    if on_slurm(trainer):
        extra.add(lightning_internals.hpc_resume_path(trainer))
    extra.discard(None)
    modified = {}
    for path in own | extra:
        fs = get_filesystem(path)
        if fs.exists(path):
            modified[path] = fs.modified(path)
    if not modified:
        return ckpt_path
    newest = max(modified, key=modified.get)  # type: ignore[arg-type]
    if newest in own:
        return ckpt_path  # Lightning finds it itself
    rank_zero_info(
        f'lightning_gaudi_fsdp: fit(ckpt_path="last") resumes from {newest}, the newest last checkpoint (an earlier '
        "run's: each run logs to a new version, and Lightning looks only in the new one's folder)"
    )
    return newest


def _earlier_versions(trainer: Any) -> set[str]:
    """The ``last*.ckpt`` in every version folder of the first logger, for ``ModelCheckpoint``s whose folder the
    logger decides (no ``dirpath``), on a local file system."""
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath is None]
    if not callbacks or not trainer.loggers:
        return set()
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    if "://" in str(save_dir):
        return set()
    root = Path(save_dir) / str(logger.name)  # as ModelCheckpoint builds <save_dir>/<name>/<version>/checkpoints
    if not root.is_dir():
        return set()
    found = set()
    for callback in callbacks:
        for folder in root.glob("*/checkpoints"):
            for path in folder.iterdir():
                if path.suffix == callback.FILE_EXTENSION and path.stem.startswith(callback.CHECKPOINT_NAME_LAST):
                    found.add(os.path.normpath(path))
    return found
