"""Describe and convert checkpoints offline: no process group, no device, about one model in memory.

Conversions: ``local -> full``, ``sharded -> full``, ``full -> sharded``, ``local -> sharded``. A converted ``full``
checkpoint loads into the plain, unwrapped LightningModule (``model.load_state_dict(ckpt["state_dict"])``). Optimizer
state is carried for ``sharded -> full`` and ``full -> sharded`` (keyed by parameter name). It is dropped, with a note
in the converted checkpoint's ``conversion_notes``, when the source is ``local`` (per-rank flat state).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from lightning_gaudi_fsdp.checkpoint import commit
from lightning_gaudi_fsdp.checkpoint.formats import (
    LOCAL_TRAINER_STATE,
    OPTIMIZER_GROUPS_KEY,
    PARAM_ID_NAMES_KEY,
    SHARDED_METADATA,
    CheckpointError,
    _save_sharded,
    _torch_load,
    detect_format,
    local_shard_name,
    optimizer_state_by_name,
    read_local_metadata,
)
from lightning_gaudi_fsdp.checkpoint.layout import unflatten

T = TypeVar("T")
Progress = Callable[[Iterable[T], str, int], Iterable[T]]


def _no_progress(items: Iterable[T], description: str, total: int) -> Iterable[T]:
    return items


def _tensor_summary(tensors: Iterable[torch.Tensor]) -> dict[str, Any]:
    count = nbytes = 0
    dtypes: dict[str, int] = {}
    for t in tensors:
        count += t.numel()
        nbytes += t.numel() * t.element_size()
        key = str(t.dtype).removeprefix("torch.")
        dtypes[key] = dtypes.get(key, 0) + t.numel()
    return {"parameters": count, "bytes": nbytes, "dtypes": dtypes}


def _trainer_fields(rest: dict[str, Any]) -> dict[str, Any]:
    return {
        "epoch": rest.get("epoch"),
        "global_step": rest.get("global_step"),
        "lightning_version": rest.get("pytorch-lightning_version"),
    }


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Format, writer's world size, parameter count and bytes, dtypes, optimizer presence, epoch/step, versions."""
    path = Path(path)
    fmt = detect_format(path)
    info: dict[str, Any] = {"path": str(path), "format": fmt}
    if fmt == "full":
        ckpt = _torch_load(path, path, "the checkpoint file")
        state = ckpt.get("state_dict", {})
        info.update(_tensor_summary(v for v in state.values() if isinstance(v, torch.Tensor)))
        info.update(world_size=None, optimizer=bool(ckpt.get("optimizer_states")), **_trainer_fields(ckpt))
    elif fmt == "sharded":
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = FileSystemReader(str(path)).read_metadata()
        rest = _torch_load(path / SHARDED_METADATA, path, "the trainer state")
        model = {
            k: md
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
        }
        meta_tensors = [torch.empty(md.size, dtype=md.properties.dtype, device="meta") for md in model.values()]
        info.update(_tensor_summary(meta_tensors))
        files = {info_.relative_path for info_ in metadata.storage_data.values()}
        info.update(
            world_size=len(files),
            optimizer=any(k.startswith("optimizer_") for k in metadata.state_dict_metadata),
            **_trainer_fields(rest),
        )
    else:
        meta = read_local_metadata(path)
        rest = _torch_load(path / LOCAL_TRAINER_STATE, path, "the trainer state")
        shapes = [(shape, entry["dtype"]) for entry in meta["flat_params"] for shape in entry["shapes"]]
        tensors = [torch.empty(s, dtype=getattr(torch, d), device="meta") for s, d in shapes]
        info.update(_tensor_summary(tensors))
        shard0 = _torch_load(path / local_shard_name(0), path, "the shard of rank 0")
        info.update(
            world_size=meta["world_size"],
            optimizer=bool(shard0.get("optimizer_states")),
            sharding_strategy=meta.get("sharding_strategy"),
            fsdp_units=len(meta.get("fsdp_units", [])),
            **_trainer_fields(rest),
        )
        info["versions"] = meta.get("versions", {})
    return info


def load_full_state(
    path: str | os.PathLike[str], progress: Progress = _no_progress
) -> tuple[dict[str, Any], list[str]]:
    """Any format as one full Lightning checkpoint dict in memory; returns it and notes about what was dropped."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "full":
        return _torch_load(path, path, "the checkpoint file"), []
    if fmt == "sharded":
        return _sharded_to_full(path), []
    return _local_to_full(path, progress)


def _sharded_to_full(path: Path) -> dict[str, Any]:
    # DCP's own offline reader (what dcp_to_torch_save uses), loading straight into tensors it allocates from the
    # metadata: one copy of the checkpoint in memory, no temporary file read back.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    rest = _torch_load(path / SHARDED_METADATA, path, "the trainer state")
    rest.pop(OPTIMIZER_GROUPS_KEY, None)
    rest["state_dict"] = state.pop("model")
    optimizers = [state[k] for k in sorted(k for k in state if k.startswith("optimizer_"))]
    if optimizers:
        rest["optimizer_states"] = optimizers
    return rest


def _local_to_full(path: Path, progress: Progress) -> tuple[dict[str, Any], list[str]]:
    meta = read_local_metadata(path)
    rest = _torch_load(path / LOCAL_TRAINER_STATE, path, "the trainer state")
    world_size = int(meta["world_size"])
    layout = meta["flat_params"]
    pieces: dict[str, list[torch.Tensor]] = {entry["key"]: [] for entry in layout}
    others: dict[str, torch.Tensor] = {}
    for rank in progress(range(world_size), "reading rank shards", world_size):
        shard = _torch_load(path / local_shard_name(rank), path, f"the shard of rank {rank}")
        for key in pieces:
            if key not in shard["model"]:
                raise CheckpointError(path, f"the shard of rank {rank} lacks {key!r}")
            pieces[key].append(shard["model"][key].reshape(-1))
        if rank == 0:
            others = {k: v for k, v in shard["model"].items() if k not in pieces}
        del shard
    state: dict[str, torch.Tensor] = dict(others)
    for entry in progress(layout, "unflattening parameters", len(layout)):
        state.update(unflatten(torch.cat(pieces.pop(entry["key"])), entry))
    rest["state_dict"] = state
    notes = ["optimizer state of a local checkpoint is per-rank flat state; it was not converted"]
    rest.pop("optimizer_states", None)
    rest["conversion_notes"] = notes
    return rest, notes


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    to: Literal["full", "sharded"],
    progress: Progress = _no_progress,
) -> list[str]:
    """Write ``src`` (any format) as ``dst`` in format ``to``; ``dst`` appears only once complete."""
    src, dst = Path(src), Path(dst)
    if to not in ("full", "sharded"):
        raise ValueError(f"to={to!r} is not supported; expected one of 'full', 'sharded'")
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination (nothing is overwritten)")
    checkpoint, notes = load_full_state(src, progress)
    staging = commit.prepare_staging(dst, directory=to == "sharded")
    try:
        if to == "full":
            torch.save(checkpoint, staging)
        else:
            _write_sharded_from_full(checkpoint, staging, notes)
        commit.commit(staging, dst)
    except BaseException:
        commit.discard(dst)
        raise
    return notes


def _write_sharded_from_full(checkpoint: dict[str, Any], staging: Path, notes: list[str]) -> None:
    """A single-process DCP save of the model and of the optimizer state, both keyed by parameter name; DCP
    reshards them on load to any world size."""
    checkpoint = dict(checkpoint)
    names = checkpoint.pop(PARAM_ID_NAMES_KEY, None)
    optimizer_states = checkpoint.pop("optimizer_states", None) or []
    by_name = []
    for state in optimizer_states:
        if any(isinstance(key, int) for key in state.get("state", {})):
            if names is None:
                notes.append(
                    "optimizer state is keyed by parameter id without the names to map it; it was not converted"
                )
                by_name = []
                break
            state = optimizer_state_by_name(state, names)
        by_name.append(state)
    if by_name:
        checkpoint["optimizer_states"] = by_name
    if notes:
        checkpoint["conversion_notes"] = list(notes)
    _save_sharded(checkpoint, staging, rank=0, no_dist=True)
