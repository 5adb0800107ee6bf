"""Full, sharded and local state-dict checkpoints of an FSDP model: detect, check, save and load.

- ``full``: one ``torch.save`` file in the layout of the door that wrote it (see :mod:`.views`). Model weights are
  gathered on rank 0 (plain names, no FSDP prefixes) under ``state_dict`` (the Trainer's layout, optimizer state in
  torch's standard per-parameter-id form) or under the model's key of Fabric's ``state`` (Fabric's layout, optimizer
  state keyed by parameter name), so a plain PyTorch/Lightning program loads it without FSDP. Given a
  :class:`~.streaming.FullStream`, rank 0 writes each tensor as it arrives instead of gathering the whole state first
  (see :mod:`.streaming`).
- ``sharded``: a directory in Lightning's distributed-checkpoint layout (torch DCP files plus ``meta.pt`` holding
  everything that is not a model or optimizer tensor; DCP keys ``model``/``optimizer_<i>``, or in Fabric's layout the
  keys of ``state``). It loads at any world size.
- ``local``: a directory with one ``rank_NNNNN.pt`` per rank (that rank's slice of every flat parameter and its raw
  optimizer state), ``trainer_state.pt`` and ``local_metadata.json`` (world size, sharding strategy, wrap and
  flat-parameter layout, versions). Fastest to write; loads only at the same world size and wrapping.

Every save is staged and committed atomically (see :mod:`.commit`); the marker file of a directory format is written
last. A save that fails on any rank fails on every rank with its cause (see :mod:`.storage`). Checking and loading
live in :mod:`.loading`, reading files safely in :mod:`.trust`. This module knows nothing about Lightning or Gaudi:
callers pass the model, optimizers, rank and an all-gather.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp import _compat
from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name
from lightning_gaudi_fsdp.checkpoint import checksum, commit, files, space, storage
from lightning_gaudi_fsdp.checkpoint.files import Remote, Where
from lightning_gaudi_fsdp.checkpoint.streaming import FullStream

CheckpointFormat = Literal["full", "sharded", "local"]
SHARDED_METADATA = "meta.pt"  # Lightning's name: a folder with it is a sharded checkpoint to Lightning too
LOCAL_METADATA = "local_metadata.json"
LOCAL_TRAINER_STATE = "trainer_state.pt"
LOCAL_FORMAT_VERSION = 1
OPTIMIZER_GROUPS_KEY = "gaudi_fsdp_optimizer_param_groups"
PARAM_ID_NAMES_KEY = "gaudi_fsdp_param_id_names"  # in full checkpoints: the name of each optimizer parameter id
ENGINE_KEY = "gaudi_fsdp_engine"  # the FSDP engine (1 or 2) that wrote the checkpoint, in its trainer state
HF_KEY = "gaudi_fsdp_hf_model"  # JSON: {"prefix": "model.", "peft": {adapter name: LoraConfig dict} | null}
BOOK_KEY = "gaudi_fsdp"  # Fabric's layout: the package's bookkeeping (see .views), naming the model and optimizers
# sharded: the number of ranks that wrote it, in meta.pt (local checkpoints keep theirs in local_metadata.json); absent
# where no world size applies (convert's single-process output) and in checkpoints written before it was recorded
WORLD_SIZE_KEY = "gaudi_fsdp_world_size"


def local_shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the path and the problem."""

    def __init__(self, path: str | os.PathLike[str] | Remote, problem: str) -> None:
        super().__init__(f"Cannot load checkpoint {str(path)!r}: {problem}")
        self.path = path if isinstance(path, Remote) else Path(path)
        self.problem = problem


def readable(path: str | os.PathLike[str] | Remote, argument: str = "path", call: str = "") -> Where:
    """Where the checkpoint a user named lies, for reading: :func:`.files.locate`, then at a URL the generation its
    commit record names (:func:`.commit.committed`). Every reader starts here."""
    return commit.committed(files.locate(path, argument, call))


def detect_format(path: str | os.PathLike[str] | Remote) -> CheckpointFormat:
    """The format of the checkpoint at ``path`` (as :func:`readable` gives it)."""
    path = files.locate(path, "path")  # every reader asks first: never a URL taken for a local path
    commit.recover(path)
    if path.is_file():
        return "full"
    if path.is_dir():
        if (path / LOCAL_METADATA).is_file():
            return "local"
        if (path / SHARDED_METADATA).is_file():
            return "sharded"
        if (not isinstance(path, Remote) and commit.staging_path(path).exists()) or path.name.endswith(
            commit.PARTIAL_SUFFIX
        ):
            raise CheckpointError(path, "the save was interrupted; the checkpoint was never committed")
        raise CheckpointError(
            path, f"the directory has neither {LOCAL_METADATA!r} (local) nor {SHARDED_METADATA!r} (sharded)"
        )
    interrupted = commit.generations(path) if isinstance(path, Remote) else [commit.staging_path(path)]
    if any(p.exists() for p in interrupted):
        raise CheckpointError(path, "the save was interrupted before it was committed; use an earlier checkpoint")
    raise CheckpointError(path, "no such file or directory")


# ---------------------------------------------------------------------------------------------------- contexts
# ---------------------------------------------------------------------------------------------- state extraction
def param_id_names(model: Module, optimizer: Optimizer | None = None) -> list[str]:
    """The parameter name for each id of an optimizer state, so offline tools can key that state by name again.

    Without ``optimizer``: ids follow ``model.parameters()``, as in a full checkpoint (``FSDP.rekey_optim_state_dict``).
    With it: ids follow the optimizer's own parameter order, as in ``optimizer.state_dict()`` (a local checkpoint);
    there, with ``use_orig_params=False``, the names are those of flat parameters (``<unit>._flat_param``)."""
    names = {id(p): clean_name(name) for name, p in model.named_parameters()}
    if optimizer is None:
        return [names[id(p)] for p in model.parameters()]
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def merge_groups(optimizer: Optimizer, state: Mapping[str, Any]) -> list[dict[str, Any]]:
    current = optimizer.state_dict()["param_groups"]
    return [{**saved, "params": cur["params"]} for saved, cur in zip(state["param_groups"], current, strict=True)]


# ------------------------------------------------------------------------------------------------------- saving
def save(
    fmt: CheckpointFormat,
    checkpoint: dict[str, Any],
    path: str | os.PathLike[str] | Remote,
    *,
    rank: int,
    world_size: int,
    gather: storage.Gather,
    local_metadata: Mapping[str, Any] | None = None,
    check_free_space: bool | None = None,
    process_group: Any = None,
    stream: FullStream | None = None,
    crc32: bool = False,
    checksums: bool = True,
) -> Path:
    """Write ``checkpoint`` (with ``state_dict`` and ``optimizer_states`` in ``fmt``) atomically to ``path``.

    Every rank calls this; ``gather`` is an all-gather of Python objects, over ``process_group`` (the group a sharded
    save coordinates over; default: the default group). Nothing appears under ``path`` unless every rank finished
    writing. If any rank fails, or free space is short before anything is written, every rank raises
    the same :class:`~.storage.CheckpointSaveError` (see :func:`~.storage.write_atomically`). ``stream``: the
    :class:`~.streaming.FullStream` the full ``checkpoint`` was built with; in the write step rank 0 receives and
    writes each tensor in turn while the other ranks send their pieces. ``crc32``: the zip archives carry a CRC32
    of each record (see :func:`.storage.zip_checksums`; ``torch.load`` never checks them). ``checksums``: every file
    is hashed while written and the digests recorded in the checkpoint (see :mod:`.checksum`, :mod:`.integrity`). At
    a URL every rank writes its own objects under a new generation that rank 0's token names (see :mod:`.commit`)."""
    path = files.locate(path, "path")
    directory = fmt != "full"
    token = gather(os.urandom(6).hex() if rank == 0 else None)[0] if isinstance(path, Remote) else ""
    staging = commit.staging_path(path, token)
    model_state, optimizer_states, rest = _split_state(checkpoint)

    def refuse_non_checkpoint_directory() -> None:
        if path.is_dir() and not directory and detect_format_or_none(path) is None:
            raise IsADirectoryError(f"Refusing to replace directory {str(path)!r} (not a checkpoint) with a file")

    expected = _size_hint(checkpoint) if fmt == "full" and rank == 0 and checksums else None
    if fmt == "full" and stream is not None and stream.pending:  # else torch's path gathered it
        writes = [lambda: stream.write(checkpoint, staging, expected) if rank == 0 else stream.send()]
    elif fmt == "full":
        writes = [lambda: save_file(checkpoint, staging, trailer=True, expected=expected) if rank == 0 else None]
    elif fmt == "sharded":
        writes = [lambda: save_sharded(checkpoint, staging, rank, world_size, process_group=process_group)]
    else:
        shard = {"model": model_state, "optimizer_states": optimizer_states}
        meta = {"format": "local", "format_version": LOCAL_FORMAT_VERSION, "world_size": world_size}
        meta.update(local_metadata or {})
        writes = [
            lambda: save_file(shard, staging / local_shard_name(rank)),
            lambda: _finish_local(rest, staging, world_size, meta) if rank == 0 else None,
        ]
    recorder = checksum.Recorder(staging if directory else staging.parent) if checksums else None
    with storage.zip_checksums(crc32), checksum.recording(recorder):
        return storage.write_atomically(
            path,
            writes,
            directory=directory,
            needed=lambda: bytes_to_write(fmt, checkpoint, rank, local_metadata),
            check_free_space=check_free_space,
            rank=rank,
            gather=gather,
            before=refuse_non_checkpoint_directory,
            recorder=recorder if directory else None,
            staging=staging,
        )


def bytes_to_write(
    fmt: CheckpointFormat, checkpoint: dict[str, Any], rank: int, local_metadata: Mapping[str, Any] | None = None
) -> int:
    """About how many bytes ``rank`` writes when saving ``checkpoint`` in ``fmt`` (rank 0 also writes what is not
    sharded)."""
    if fmt == "full":
        return space.estimate_bytes(checkpoint) if rank == 0 else 0
    model_state, optimizer_states, rest = _split_state(checkpoint)
    if fmt == "sharded":
        own = space.estimate_bytes(_dcp_state(checkpoint, model_state, optimizer_states), tensors="elements")
    else:
        own = space.estimate_bytes({"model": model_state, "optimizer_states": optimizer_states})
    if rank == 0:
        own += space.estimate_bytes(rest) + len(json.dumps(dict(local_metadata or {}), default=str))
    return own


def _size_hint(checkpoint: dict[str, Any]) -> int | None:
    """About the bytes of a full checkpoint, for the block its checksums are computed in; None if unknown."""
    try:
        return space.estimate_bytes(checkpoint)
    except Exception:  # noqa: BLE001 - the free-space check reports an estimate that fails
        return None


def save_file(obj: Any, file: Where, *, trailer: bool = False, expected: int | None = None) -> None:
    """``torch.save`` through a Python file (:func:`.files.open_write`): a failed write then carries its errno
    (``ENOSPC``...) and the file is closed at once; with a path, torch's own writer reports only "unexpected pos" and
    keeps the file open, and its space allocated, for as long as the exception lives. While a save records checksums
    the file is hashed as it is written; ``trailer``: the file is a checkpoint of its own and carries them (see
    :mod:`.checksum`)."""
    with checksum.open_for_writing(file, trailer=trailer, expected=expected) as handle:
        torch.save(obj, handle)


def detect_format_or_none(path: Where) -> CheckpointFormat | None:
    try:
        return detect_format(path)
    except CheckpointError:
        return None


def _split_state(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """The model state, the optimizer states and the rest, of a checkpoint in the Trainer's layout or in Fabric's
    (whose :data:`BOOK_KEY` names the model's and optimizers' entries)."""
    rest = dict(checkpoint)
    book = rest.get(BOOK_KEY)
    if isinstance(book, Mapping):
        return rest.pop(book["model"], {}), [rest.pop(k) for k in book["optimizers"] if k in rest], rest
    model_state = rest.pop("state_dict", {})
    optimizer_states = rest.pop("optimizer_states", [])
    return model_state, optimizer_states, rest


def _dcp_state(checkpoint: dict[str, Any], model_state: dict[str, Any], optimizer_states: list[Any]) -> dict[str, Any]:
    """The DCP entries: the Trainer's keys (``model``, ``optimizer_<i>``), or in Fabric's layout the keys of the
    ``state`` given to ``fabric.save``, as Lightning's Fabric writes them."""
    book = checkpoint.get(BOOK_KEY)
    if isinstance(book, Mapping):
        return {book["model"]: model_state, **dict(zip(book["optimizers"], optimizer_states, strict=True))}
    return {"model": model_state, **{f"optimizer_{i}": s for i, s in enumerate(optimizer_states)}}


def save_sharded(
    checkpoint: dict[str, Any],
    staging: Where,
    rank: int,
    world_size: int | None,
    no_dist: bool = False,
    process_group: Any = None,
) -> None:
    """Lightning's sharded layout. ``world_size``: the writers' number, recorded in the trainer state (None: not
    recorded). ``no_dist``: one process writes full tensors (offline conversion); DCP reshards them on load like any
    other."""
    model_state, optimizer_states, rest = _split_state(checkpoint)
    state = _dcp_state(checkpoint, model_state, optimizer_states)
    writer = files.dcp_writer(staging)  # every file through the storage seam
    recorder = checksum.active()
    if recorder is not None:  # DCP may write from threads of its own: the recorder is handed over, not looked up
        wrap = functools.partial(recorder.wrap, entries=True)  # each entry in blocks of its own
        writer = torch_internals.dcp_writer_through(writer, wrap, recorder.rename)
    _compat.dcp_save(state, str(staging), no_dist=no_dist, process_group=process_group, storage_writer=writer)
    if rank == 0:
        # Kept beside Lightning's metadata for optimizers whose per-parameter state is empty.
        extras: dict[str, Any] = {
            OPTIMIZER_GROUPS_KEY: [{"param_groups": s.get("param_groups", [])} for s in optimizer_states]
        }
        if world_size is not None:
            extras[WORLD_SIZE_KEY] = world_size
        if isinstance(rest.get(BOOK_KEY), Mapping):
            rest[BOOK_KEY] = {**rest[BOOK_KEY], **extras}  # Fabric's layout: the bookkeeping under its one key
        else:
            rest.update(extras)
        save_file(rest, staging / SHARDED_METADATA)


def _finish_local(rest: dict[str, Any], staging: Where, world_size: int, meta: Mapping[str, Any]) -> None:
    """Rank 0, once every rank wrote its shard: the trainer state, then the marker that makes it a checkpoint."""
    save_file(rest, staging / LOCAL_TRAINER_STATE)
    missing = [r for r in range(world_size) if not (staging / local_shard_name(r)).is_file()]
    if missing:
        raise RuntimeError(f"local checkpoint: shards of ranks {missing} were not written to {staging}")
    # The marker is written last: a directory without it is never taken for a checkpoint.
    with checksum.open_for_writing(staging / LOCAL_METADATA) as handle:
        handle.write(json.dumps(meta, indent=2, sort_keys=True).encode())


def local_metadata(
    engine_version: int,
    layout: Mapping[str, Any],
    model: Module,
    sharding_strategy: str,
    versions: Mapping[str, str],
    optimizers: Sequence[Optimizer] = (),
) -> dict[str, Any]:
    """A local checkpoint's metadata: the engine that wrote it (``engine_version``, read back by
    :func:`local_engine`), ``layout`` (the engine's record of the model), the sharding strategy, each optimizer's
    parameter names and the versions."""
    return {
        "engine": engine_version,
        **layout,
        "sharding_strategy": sharding_strategy,
        "optimizer_param_names": [param_id_names(model, optimizer) for optimizer in optimizers],
        "versions": dict(versions),
    }


def local_engine(meta: Mapping[str, Any]) -> int:
    """The engine (1 or 2) that wrote a local checkpoint, from its metadata (:func:`local_metadata`); one written
    before the package had a second engine records none: FSDP1."""
    return meta.get("engine", 1)


def read_local_metadata(path: Where) -> dict[str, Any]:
    try:
        return json.loads((path / LOCAL_METADATA).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(path, f"{LOCAL_METADATA} is unreadable ({err})") from err
