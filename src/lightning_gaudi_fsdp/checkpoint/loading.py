"""Check a checkpoint against the model on every rank, then load it: full, sharded or local (format from disk).

:func:`check_load` reads and checks what this rank needs without changing the model; the caller lets the ranks agree
on the outcome, then :func:`apply_load` changes the weights. Nothing here knows about Lightning or Gaudi.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.checkpoint import fast_load, files, integrity
from lightning_gaudi_fsdp.checkpoint.formats import (
    LOCAL_TRAINER_STATE,
    OPTIMIZER_GROUPS_KEY,
    SHARDED_METADATA,
    WORLD_SIZE_KEY,
    CheckpointError,
    CheckpointFormat,
    detect_format,
    local_engine,
    local_shard_name,
    merge_groups,
    read_local_metadata,
    readable,
)
from lightning_gaudi_fsdp.checkpoint.space import human_bytes
from lightning_gaudi_fsdp.checkpoint.trust import (
    check_distributed_entries,
    load_file,
    read_distributed,
    storage_reader,
)
from lightning_gaudi_fsdp.checkpoint.views import (
    dcp_model_key,
    dcp_optimizer_key,
    file_view,
    internal_view,
    with_dcp_keys,
)
from lightning_gaudi_fsdp.engine.pieces import gather_objects

log = logging.getLogger(__name__)

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------------ checking
def check_state_keys(
    path: Path, saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], strict: bool
) -> None:
    missing = sorted(set(expected) - set(saved)) if strict else []  # strict=False loads a partial state
    unexpected = sorted(set(saved) - set(expected)) if strict else []
    wrong = sorted(k for k in set(saved) & set(expected) if tuple(saved[k]) != tuple(expected[k]))
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} parameter(s) of this model, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} parameter(s) this model does not have, e.g. {unexpected[:3]}")
    if wrong:
        k = wrong[0]
        problems.append(f"{len(wrong)} shape mismatch(es), e.g. {k!r} saved {tuple(saved[k])} vs model {expected[k]}")
    if problems:
        raise CheckpointError(path, "it was written for another model: " + "; ".join(problems))


def check_sharded(
    path: Path,
    model_state: Mapping[str, Any],
    strict: bool,
    weights_only: bool,
    view: dict[str, Any],
    hints: Hints,
    reader: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Read and check the DCP metadata against ``model_state`` (a sharded state dict); returns the metadata and
    ``view`` (the checkpoint's rest) naming the DCP keys of the model and optimizers. With ``weights_only``, every
    non-tensor entry is also unpickled safely (they are small). ``reader``: the :func:`.trust.storage_reader` to
    read with (it keeps the metadata for later reads)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = reader if reader is not None else storage_reader(path, weights_only=weights_only)
    try:
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(path, f"the distributed-checkpoint metadata (.metadata) is unreadable: {err}") from err
    ends: dict[str, int] = {}  # each shard file's last byte any entry needs: one stat per file, not per entry
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for relative, end in ends.items():
        file = path / relative
        if not file.is_file():
            raise CheckpointError(path, f"shard file {relative!r} is missing")
        if files.size(file) < end:
            raise CheckpointError(path, f"shard file {relative!r} is truncated")
    if weights_only:
        check_distributed_entries(path, metadata, reader=reader)
    view = with_dcp_keys(view, list(metadata.state_dict_metadata), *hints)
    prefix = f"{dcp_model_key(view)}."
    saved = {
        key.removeprefix(prefix): tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    expected = {k: _global_shape(v) for k, v in model_state.items() if hasattr(v, "size")}
    check_state_keys(path, saved, expected, strict)
    return metadata, view


def _global_shape(value: Any) -> tuple[int, ...]:
    """The full shape of a state-dict entry; a ``ShardedTensor``'s from its metadata (its ``size()`` goes through
    ``__torch_function__``, about 0.3 ms each: a fifth of a second at 723 tensors)."""
    metadata = getattr(value, "metadata", None)
    if hasattr(value, "local_shards") and callable(metadata):
        return tuple(metadata().size)
    return tuple(value.size())


def check_local(path: Path, model: Module, engine: Any, world_size: int, rank: int) -> dict[str, Any]:
    meta = read_local_metadata(path)
    if meta.get("world_size") != world_size:
        raise CheckpointError(
            path,
            f"this local checkpoint was saved with world size {meta.get('world_size')} and this run has world size "
            f"{world_size}; a local checkpoint only loads at the world size that wrote it. Convert it with "
            f"`lightning-gaudi-fsdp convert {path} OUT --to sharded` to load it at another size",
        )
    if local_engine(meta) != engine.version:
        raise CheckpointError(
            path,
            f"this local checkpoint was written by the FSDP{local_engine(meta)} engine and this run uses "
            f"FSDP{engine.version} (fsdp_version={engine.version}); a local checkpoint only loads on the engine that "
            f"wrote it. Convert it with `lightning-gaudi-fsdp convert {path} OUT --to sharded` to load it on the "
            "other engine",
        )
    engine.check_local_layout(path, meta, model)
    return meta


# ------------------------------------------------------------------------------------------------------- loading
Hints = tuple[str | None, Sequence[str]]  # at fabric.load: the keys of the model and optimizers in the user's state


@dataclass
class PendingLoad:
    """A checkpoint that passed every check on this rank; :func:`apply_load` changes the weights."""

    fmt: CheckpointFormat
    path: Path
    rest: dict[str, Any]
    model_state: dict[str, Any] = field(default_factory=dict)
    optimizer_states: list[Any] | None = None
    dcp_metadata: Any = None
    weights_only: bool = True
    optimizer_groups: list[Any] = field(default_factory=list)  # hyper-parameters kept beside sharded state
    dcp_reader: Any = None  # sharded: the reader that read the metadata, kept for the data (read once)
    verified: bool | None = None  # its checksums verified (False: it has none; None: not checked)


def check_load(
    path: str | os.PathLike[str],
    model: Module,
    *,
    engine: Any,
    world_size: int,
    rank: int,
    device_type: str,
    strict: bool,
    weights_only: bool = True,
    raw: bool = False,
    hints: Hints = (None, ()),
    verify: bool = True,
) -> PendingLoad:
    """Detect the format of ``path``, read what this rank needs and check it against ``model`` and the world size.
    Raises :class:`CheckpointError`; nothing in ``model`` is changed. Every file is unpickled with ``weights_only``
    (see :mod:`.trust`); ``False`` only for a checkpoint whose source is trusted. ``raw``: a single file may also be
    a plain model state dict (``torch.save(model.state_dict())``), not only a Lightning checkpoint. ``hints``: where
    the model and optimizers are in a checkpoint of Lightning's own Fabric (see :func:`.views.internal_view`).
    ``verify``: first check this rank's part of the checkpoint's checksums (:func:`.integrity.verify`), raising
    :class:`~.integrity.CheckpointIntegrityError`; whether it had any is in the result's ``verified``.

    Building a sharded or local state dict runs collectives, so it happens before any check that could fail on one
    rank only: every rank reaches the caller's agreement step having run the same collectives."""
    path = readable(path)
    fmt = integrity.format_of(path) if verify else detect_format(path)  # a marker file listed but missing: named
    if fmt in ("sharded", "local"):
        current = engine.current_state(model, fmt, device_type)
    verified = verify_share(path, rank, world_size) if verify else None
    if fmt == "full":
        checkpoint = load_file(path, path, "the checkpoint file", weights_only=weights_only)
        state, checkpoint = split_model_state(path, checkpoint, raw, hints)
        saved = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        check_state_keys(path, saved, engine.expected_full_shapes(model), strict)
        optimizer_states = checkpoint.pop("optimizer_states", None)
        return PendingLoad(fmt, path, checkpoint, state, optimizer_states, weights_only=weights_only, verified=verified)
    if fmt == "sharded":
        rest = load_file(path / SHARDED_METADATA, path, "the trainer state", weights_only=weights_only)
        rest = internal_view(rest, path)
        reader = storage_reader(path, weights_only=weights_only)
        metadata, rest = check_sharded(path, current, strict, weights_only, rest, hints, reader)
        return PendingLoad(
            fmt,
            path,
            rest,
            current,
            dcp_metadata=metadata,
            weights_only=weights_only,
            dcp_reader=reader,
            verified=verified,
        )
    check_local(path, model, engine, world_size, rank)
    rest = load_file(path / LOCAL_TRAINER_STATE, path, "the trainer state", weights_only=weights_only)
    rest = internal_view(rest, path)
    shard = load_file(path / local_shard_name(rank), path, f"the shard of rank {rank}", weights_only=weights_only)
    if not isinstance(shard, dict) or "model" not in shard:
        raise CheckpointError(path, f"the shard of rank {rank} holds no model state")
    keys = engine.local_shard_keys(current)
    missing = [k for k in keys if k not in shard["model"]]
    if missing:
        raise CheckpointError(path, f"the shard of rank {rank} lacks {missing[:3]}")
    for key in keys:  # a rank file that does not match its metadata's layout fails the check, never the load
        saved, held = shard["model"][key], _local_numel(current[key])
        if isinstance(saved, torch.Tensor) and saved.numel() != held:
            raise CheckpointError(
                path, f"the shard of rank {rank} holds {saved.numel()} elements of {key!r}; this rank holds {held}"
            )
    return PendingLoad(
        fmt, path, rest, shard["model"], shard.get("optimizer_states"), weights_only=weights_only, verified=verified
    )


def verify_share(path: Any, rank: int, world_size: int) -> bool:
    """This rank's part of :func:`.integrity.verify`: False for a checkpoint without checksums (the caller says, in
    one line, that it is loaded unverified: :data:`.integrity.NOT_VERIFIED`)."""
    return integrity.verify(path, rank=rank, world_size=world_size)


def _local_numel(value: Any) -> int:
    """The elements of a local state-dict entry this rank holds: a ``ShardedTensor``'s local shards (FSDP1), a
    ``DTensor``'s local tensor (FSDP2) or a plain tensor."""
    if hasattr(value, "local_shards"):
        return sum(shard.tensor.numel() for shard in value.local_shards())
    if hasattr(value, "to_local"):
        return value.to_local().numel()
    return value.numel()


def split_model_state(
    path: Path, checkpoint: Any, raw: bool, hints: Hints = (None, ())
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model state and the rest (the internal view, see :mod:`.views`) of a single-file checkpoint in the
    Trainer's layout or Fabric's, or with ``raw`` a plain state dict (names to tensors)."""
    view = file_view(checkpoint, path, raw=raw, model_key=hints[0], optimizer_keys=hints[1])
    return view.pop("state_dict"), view


def read_full_model_state(path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
    """The full model state of any checkpoint (every format, read offline by this process alone) or of a plain
    state-dict file: what an unsharded model loads."""
    from lightning_gaudi_fsdp.checkpoint.convert import load_full_state

    path = readable(path)
    if detect_format(path) == "full":
        return split_model_state(path, load_file(path, path, "the checkpoint file", weights_only=weights_only), True)[0]
    return load_full_state(path, weights_only=weights_only)[0]["state_dict"]


def read_full_optimizer_state(path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
    """The optimizer state of a single file: the one optimizer of a full Lightning checkpoint, or a plain
    ``optimizer.state_dict()`` (keyed by parameter id, or by name as FSDP writes it)."""
    path = readable(path)
    if detect_format(path) != "full":
        raise CheckpointError(
            path,
            "an optimizer alone loads from a single file (a full checkpoint or torch.save(optimizer.state_dict())); "
            "load sharded and local checkpoints with their model: fabric.load(path, {'model': model, "
            "'optimizer': optimizer})",
        )
    checkpoint = load_file(path, path, "the checkpoint file", weights_only=weights_only)
    if isinstance(checkpoint, dict) and {"state", "param_groups"} <= set(checkpoint):
        return checkpoint
    checkpoint = internal_view(checkpoint, path, raw=True)
    if "optimizer_states" in checkpoint:
        states = checkpoint["optimizer_states"]
        if len(states) != 1:
            raise CheckpointError(path, f"it holds {len(states)} optimizer states; which one to load is ambiguous")
        return states[0]
    raise CheckpointError(path, "it holds no optimizer state ('optimizer_states', or 'state' and 'param_groups')")


def apply_load(
    pending: PendingLoad,
    model: Module,
    optimizers: Sequence[Optimizer],
    *,
    engine: Any,
    device_type: str,
    strict: bool,
    load_optimizers: bool,
) -> dict[str, Any]:
    """Load the checked state into ``model`` (and ``optimizers``) with ``engine``; returns the remaining trainer
    state."""
    rest = pending.rest
    pending.optimizer_groups = rest.pop(OPTIMIZER_GROUPS_KEY, [])  # ours, not Lightning's: never handed back
    rest.pop(WORLD_SIZE_KEY, None)  # likewise (shown by `inspect`)
    engine.apply_load(
        pending, model, optimizers, device_type=device_type, strict=strict, load_optimizers=load_optimizers
    )
    return rest


RESTORE_NOTE_AFTER_S = 5.0  # a restore that takes longer says, once it ended, what was read, how much and how fast


def restore_note(pending: PendingLoad, seconds: float, world_size: int) -> str | None:
    """The line rank 0 prints after a restore that took ``seconds`` (``None`` for a quick one): the checkpoint, its
    format, its size on disk and the rate at which the ``world_size`` ranks read it together."""
    if seconds < RESTORE_NOTE_AFTER_S:
        return None
    path = pending.path
    size = files.size(path)
    return (
        f"lightning_gaudi_fsdp: restored the {pending.fmt} checkpoint {str(path)!r} ({human_bytes(size)} on disk, "
        f"read by {world_size} rank(s)) in {seconds:.1f} s: {human_bytes(int(size / max(seconds, 1e-3)))}/s"
    )


def for_each_sharded_optimizer(
    pending: PendingLoad, optimizers: Sequence[Optimizer], load_one: Callable[[str, Optimizer], None]
) -> None:
    """Call ``load_one(key, optimizer)`` for each optimizer whose per-parameter state the sharded checkpoint holds;
    an optimizer with no such state (e.g. SGD without momentum) gets the hyper-parameters stored beside it. Nothing
    happens for a checkpoint without optimizer state (weights only)."""
    path, keys = pending.path, set(pending.dcp_metadata.state_dict_metadata)
    groups = pending.optimizer_groups
    model_prefix = f"{dcp_model_key(pending.rest)}."
    if all(k.startswith(model_prefix) for k in keys):
        return
    for idx, optimizer in enumerate(optimizers):
        key = dcp_optimizer_key(pending.rest, idx)
        if key is None or not any(k.startswith(f"{key}.") for k in keys):
            raise CheckpointError(path, f"it holds no state for optimizer {idx}")
        if not any(k.startswith(f"{key}.state.") for k in keys):
            if idx < len(groups):
                optimizer.load_state_dict({"state": {}, "param_groups": merge_groups(optimizer, groups[idx])})
            continue
        load_one(key, optimizer)


def check_optimizer_count(path: Path, states: Sequence[Any], optimizers: Sequence[Optimizer]) -> None:
    if len(states) != len(optimizers):
        raise CheckpointError(path, f"it holds {len(states)} optimizer state(s); this run has {len(optimizers)}")


def load_sharded_fast(
    pending: PendingLoad,
    model: Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
    load_optimizers: bool,
    params_of: Callable[[Module], fast_load.Params | None],
) -> bool:
    """Load a sharded checkpoint with one read straight into this rank's shards (see :mod:`.fast_load`); ``False``
    (nothing changed) where torch's path must do it. Every rank decides the same way (the decision depends on the
    model's structure and the checkpoint only). ``params_of``: the calling engine's ``fast_load_params``."""
    planned = fast_load.plan(
        model,
        pending.model_state,
        optimizers,
        pending.dcp_metadata,
        pending.optimizer_groups,
        strict=strict,
        load_optimizers=load_optimizers,
        params_of=params_of,
        model_key=dcp_model_key(pending.rest),
        optimizer_keys=[dcp_optimizer_key(pending.rest, idx) for idx in range(len(optimizers))],
    )
    if planned is None:
        log.debug("torch's path loads the sharded checkpoint %s", pending.path)
        return False
    log.debug("read straight into this rank's shards: the sharded checkpoint %s", pending.path)

    def read_here(pieces: fast_load.Pieces, planner: Any) -> None:
        try:
            done = fast_load.read_pieces(pending.path, pending.dcp_metadata, pieces)
        except CheckpointError:
            raise
        except Exception as err:  # damage, or an entry safe loading refuses: named as DCP's own reader names it
            raise CheckpointError(pending.path, f"the distributed checkpoint could not be read: {err}") from err
        if not done:
            read_distributed(pending.path, {}, planner, weights_only=pending.weights_only, reader=pending.dcp_reader)

    def read(pieces: fast_load.Pieces, planner: Any) -> None:
        # each rank reads alone (no collective), so one that fails tells the others, as torch's dcp.load does
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        agreed(pending.path, lambda: read_here(pieces, planner), world_size)

    fast_load.apply(planned, read)
    return True


def agreed(path: Path, read: Callable[[], T], world_size: int) -> T:
    """``read()`` on every rank; if it raised on any rank, every rank raises the same :class:`CheckpointError`
    naming the first rank that failed and its problem (any other exception as ``Type: message``), so that none goes
    on to a collective alone or waits in this one (one gather of every rank's outcome). A damaged checkpoint raises
    :class:`~.integrity.CheckpointIntegrityError` on every rank."""
    result, error, cause = None, None, None
    try:
        result = read()
    except CheckpointError as err:
        error, cause = (err.problem, isinstance(err, integrity.CheckpointIntegrityError)), err
    except Exception as err:  # e.g. an OSError while reading: the other ranks must hear of it too
        error, cause = (f"{type(err).__name__}: {err}", False), err
    errors = gather_objects(error, world_size)
    failed = [(rank, found) for rank, found in enumerate(errors) if found]
    if failed:
        rank, (problem, damaged) = failed[0]
        kind = integrity.CheckpointIntegrityError if damaged else CheckpointError
        raise kind(path, f"{problem} (reported by rank {rank})") from cause
    return result  # type: ignore[return-value]
