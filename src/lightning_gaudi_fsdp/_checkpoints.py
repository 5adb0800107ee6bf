"""What the two front doors share about checkpoints: the extra entries they record, saving (before returning or in
the background), and loading only once every rank has checked the checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp import _report, gaudi
from lightning_gaudi_fsdp.adapters import lightning_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name
from lightning_gaudi_fsdp.checkpoint import commit, files, formats, integrity, loading, space, storage, streaming
from lightning_gaudi_fsdp.checkpoint.background import BackgroundSaver
from lightning_gaudi_fsdp.checkpoint.staging import Defer
from lightning_gaudi_fsdp.checkpoint.streaming import FullStream
from lightning_gaudi_fsdp.engine.pieces import gather_objects

T = TypeVar("T")


def agreed_path(door: Any, path: Any, argument: str, call: str) -> files.Where:
    """``path`` (an argument of the door's ``call``) as rank 0 has it, on every rank: a local path or a URL
    (:func:`.files.locate`); what cannot be honoured is refused there, before anything is read or written."""
    return files.locate(door.broadcast(str(path)), argument, call)


def remove_checkpoint(door: Any, path: Any, remove_local: Callable[[Any], None]) -> None:
    """The door's ``remove_checkpoint``: a checkpoint at a URL deleted whole on rank 0 (its commit record first, then
    its data: see :func:`.commit.remove_checkpoint`); a local one by ``remove_local`` (Lightning's own)."""
    where = files.locate(path, "filepath", "remove_checkpoint")
    if not files.is_remote(where):
        remove_local(path)
    elif door.is_global_zero:
        commit.remove_checkpoint(where)


def trainer_load_path(strategy: Any, checkpoint_path: Any) -> files.Where:
    """:func:`agreed_path` for the ``ckpt_path`` of the Trainer call that restores (``trainer.validate``...)."""
    call = f"trainer.{strategy.lightning_module.trainer.state.fn.value}"
    return agreed_path(strategy, checkpoint_path, "ckpt_path", call)


def checkpoint_extras(door: Any, model: Module, checkpoint: dict[str, Any], optimizers: Sequence[Optimizer]) -> Any:
    """Record the engine, where a Hugging Face model sits (and its PEFT configuration), and, for full checkpoints
    with optimizer state, the parameter names in ``checkpoint``; returns the local-format metadata (None for the
    other formats)."""
    from lightning_gaudi_fsdp.checkpoint import hf_export

    checkpoint[formats.ENGINE_KEY] = door._engine.version
    record = hf_export.hf_model_record(model)
    if record is not None:  # where the Hugging Face model sits, and its PEFT adapter configuration (for export)
        checkpoint[formats.HF_KEY] = record
    if door._config.state_dict_type == "full" and checkpoint.get("optimizer_states"):
        checkpoint[formats.PARAM_ID_NAMES_KEY] = formats.param_id_names(model)
    if door._config.state_dict_type != "local":
        return None
    layout = door._engine.local_layout(model)
    return formats.local_metadata(
        door._engine.version, layout, model, door._config.sharding_strategy.name, _report.versions(), optimizers
    )


def background_saver(async_save: bool, timeout: timedelta | None) -> BackgroundSaver | None:
    """``async_save``: the saver both doors hand their checkpoints to (``timeout``: of its process group), or None."""
    return BackgroundSaver(timeout) if async_save else None


def full_stream(door: Any) -> FullStream | None:
    """A :class:`~.checkpoint.streaming.FullStream` for the next full checkpoint of ``door``, or None: only for
    ``state_dict_type="full"`` and a torch whose writer the stream was checked with. The caller makes sure nothing
    but :func:`save_checkpoint` reads the checkpoint built with it."""
    if door._config.state_dict_type != "full":
        return None
    return FullStream(door.global_rank) if streaming.available() else None


def trainer_full_stream(strategy: Any) -> FullStream | None:
    """The stream for the full checkpoint the Trainer door's ``lightning_module_state_dict`` starts, or None.

    A full checkpoint that ``Trainer.save_checkpoint`` builds and hands to ``save_checkpoint``, with no hook reading it
    in between, is streamed: rank 0 holds placeholders until ``save_checkpoint`` writes them as they arrive. The plan
    waits on the strategy until then; nothing is sent before the save's write step, so a plan that is never written
    leaves no rank waiting on a send."""
    stream = full_stream(strategy)
    if stream is None or not lightning_internals.building_checkpoint_to_save() or hooks_read_checkpoint(strategy):
        return None
    return stream


def finish_trainer_saves(strategy: Any) -> None:
    """At the Trainer door's teardown: wait for its background saves (an interrupted run's last one is not made)."""
    if strategy._background is None:
        return
    from lightning.pytorch.trainer.states import TrainerStatus

    trainer = lightning_internals.attached_trainer(strategy.lightning_module)
    interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
    gather = functools.partial(gather_objects, world_size=strategy.world_size)
    strategy._background.finish(rank=strategy.global_rank, gather=gather, interrupted=interrupted)


def save_checkpoint(
    door: Any,
    checkpoint: dict[str, Any],
    path: Path,
    local_metadata: Any,
    model: Module,
    optimizers: Sequence[Optimizer],
    stream: FullStream | None = None,
) -> None:
    """Write ``checkpoint`` in the door's ``state_dict_type`` with the commit protocol; in the background when the
    door's saver is active (see :mod:`.checkpoint.background`), else before returning. In the background, the copies
    of ``model``'s parameters and ``optimizers``' state are made after this returns (see :func:`written_by_step`):
    the door calls :func:`wait_for_copies` before its next optimizer step. ``stream``: the one ``checkpoint`` was
    built with (:func:`full_stream`); in the background, its pieces are staged like a sharded save's shards and the
    thread streams the file from those copies."""
    save = functools.partial(
        formats.save,
        door._config.state_dict_type,
        path=path,
        rank=door.global_rank,
        world_size=door.world_size,
        local_metadata=local_metadata,
        check_free_space=door._config.check_free_space,
        crc32=door._config.checkpoint_crc32,
        checksums=door._config.verify_checkpoints,
    )

    def gather(obj: Any) -> list[Any]:
        return gather_objects(obj, door.world_size)

    background = door._background
    if background is None or not background.active:
        save(checkpoint, gather=gather, stream=stream)
        return
    # staged off a Gaudi device into pinned host memory (the same allocator each time keeps the buffers)
    background.use_host_buffers(gaudi.host_staging_allocator(door.root_device.type))
    defer = written_by_step(model, optimizers, door._engine.held_tensors(model))
    if stream is not None:
        # The pieces rank 0 receives are views of the ranks' live shards: staged (later, like a sharded save's
        # shards) and sent from those copies over the thread's group; the placeholders stay as they are.
        defer = dataclasses.replace(defer, as_is=stream.is_placeholder)

    def write(staged: Any, gather_in_thread: storage.Gather, group: Any) -> None:
        if stream is None:
            save(staged, gather=gather_in_thread, process_group=group)
            return
        pieces = stream.with_pieces(staged[1], group)
        save(staged[0], gather=gather_in_thread, process_group=group, stream=pieces)

    staged_obj = checkpoint if stream is None else (checkpoint, stream.pieces())
    background.save(staged_obj, path, write, rank=door.global_rank, gather=gather, defer=defer)


def written_by_step(model: Module, optimizers: Sequence[Optimizer], held: Sequence[torch.Tensor]) -> Defer:
    """What an asynchronous save may copy while the next forward and backward run: tensors in host memory that share
    their memory with ``model``'s parameters (and ``held``: the engine's other shard tensors, FSDP1's flat parameters)
    or ``optimizers``' state, which only
    an optimizer step writes; the parameters and that state are watched for in-place writes until then. Off an
    accelerator the copy is made at once, into pinned memory at DMA speed."""
    named = [(clean_name(name), param) for name, param in model.named_parameters()]
    names = {id(param): name for name, param in named}
    watch: list[tuple[str, torch.Tensor]] = list(named)
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            owner = names.get(id(param), "a parameter")
            watch += [(f"{key} of {owner} (optimizer state)", v) for key, v in state.items() if torch.is_tensor(v)]
    live = {
        local.untyped_storage().data_ptr()
        for tensor in [*(t for _, t in watch), *held]
        for local in space.local_tensors(tensor) or ()
        if local.device.type == "cpu"
    }

    def picks(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in live

    return Defer(picks, watch)


def wait_for_copies(door: Any) -> None:
    """Before an optimizer step: wait until the asynchronous save in flight has copied what the step writes."""
    if door._background is not None:
        door._background.wait_staged(rank=door.global_rank)


def wait_for_saves(door: Any, waiting: str) -> None:
    """Wait for the door's background save in flight, raising its failure on every rank (every rank calls this)."""
    if door._background is not None:
        door._background.wait(
            rank=door.global_rank, gather=lambda obj: gather_objects(obj, door.world_size), waiting=waiting
        )


def agreed(door: Any, path: Path, read: Callable[[], T]) -> T:
    """``read()`` on every rank of ``door``; any rank's failure raises the same error on every rank (see
    :func:`.loading.agreed`)."""
    return loading.agreed(path, read, door.world_size)


def load_agreed(
    door: Any,
    path: Path,
    model: Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool,
    weights_only: bool,
    load_optimizers: bool,
    raw: bool = False,
    hints: loading.Hints = (None, ()),
) -> dict[str, Any]:
    """Check ``path`` against ``model`` on every rank; only when every rank passed, load it (model, optimizers).
    Returns the rest of the checkpoint. Any rank's problem raises :class:`~.formats.CheckpointError` on every rank
    before a weight changes: nobody waits in a collective alone. ``raw``, ``hints``: see
    :func:`.loading.check_load`."""
    device_type = door.root_device.type
    started = time.perf_counter()
    with collection_paused():
        pending = agreed(
            door,
            path,
            lambda: loading.check_load(
                path,
                model,
                engine=door._engine,
                world_size=door.world_size,
                rank=door.global_rank,
                device_type=device_type,
                strict=strict,
                weights_only=weights_only,
                raw=raw,
                hints=hints,
                verify=door._config.verify_checkpoints,
            ),
        )
        rest = loading.apply_load(
            pending,
            model,
            optimizers,
            engine=door._engine,
            device_type=device_type,
            strict=strict,
            load_optimizers=load_optimizers,
        )
    if pending.verified is False:  # one line: loaded as before, unverified
        rank_zero_info(integrity.NOT_VERIFIED.format(path=str(pending.path)))
    note = loading.restore_note(pending, time.perf_counter() - started, door.world_size)
    if note is not None:
        rank_zero_info(note)
    return rest


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's automatic garbage collection paused while a checkpoint is restored. A restore builds thousands of
    small objects (a sharded checkpoint's metadata: about 3000 records at 80 layers; a plan entry per piece), which
    makes a full collection fall due on one rank in the middle of it: a pass over every object of the process (torch,
    Lightning, transformers: about a quarter of a second on 2 CPU ranks), while the other ranks wait for that one at
    the next collective. Most of these objects are gone when the restore ends; the collector then runs as before.
    torchtitan pauses the automatic collector during training for the same reason (one rank's pause stalls all)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def hooks_read_checkpoint(strategy: Any) -> bool:
    """Whether an ``on_save_checkpoint`` hook sees the checkpoint before it is written: overridden by the
    LightningModule, the datamodule, a callback or the precision plugin."""
    from lightning.pytorch import Callback, LightningDataModule, LightningModule
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.model_helpers import is_overridden

    trainer = strategy.lightning_module.trainer
    hooked: list[tuple[Any, type]] = [
        (trainer.lightning_module, LightningModule),
        (trainer.datamodule, LightningDataModule),
        (strategy.precision_plugin, Precision),
        *((callback, Callback) for callback in trainer.callbacks),
    ]
    # LightningDataModule defines no such hook (Lightning calls none on it); one a datamodule adds counts as well
    return any(
        is_overridden("on_save_checkpoint", obj, parent)
        if hasattr(parent, "on_save_checkpoint")
        else callable(getattr(obj, "on_save_checkpoint", None))
        for obj, parent in hooked
    )


def then_wait_for_copies(closure: Callable[[], Any], strategy: Any) -> Any:
    """Run the optimizer step's ``closure``, then wait until the background saver's copies of the weights are made."""
    output = closure()
    wait_for_copies(strategy)
    return output
