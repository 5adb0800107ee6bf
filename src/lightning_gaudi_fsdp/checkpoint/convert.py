"""Describe and convert checkpoints offline: no process group, no device, about one model in memory.

Conversions: ``local -> full``, ``sharded -> full``, ``full -> sharded``, ``local -> sharded``. A converted ``full``
checkpoint loads into the plain, unwrapped model (``model.load_state_dict(ckpt["state_dict"])``, or ``ckpt["model"]``
for a checkpoint in Fabric's layout: each checkpoint keeps the layout of the door that wrote it). Optimizer
state is carried in every conversion, keyed by parameter name (a local checkpoint's per-rank slices are joined). It
is dropped, with a note in ``conversion_notes``, only where the source cannot name its optimizer parameters (a full
checkpoint keyed by id without recorded names, or a local one written by an older version).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import join_name
from lightning_gaudi_fsdp.checkpoint import checksum, commit, files, integrity, storage
from lightning_gaudi_fsdp.checkpoint.formats import (
    ENGINE_KEY,
    HF_KEY,
    LOCAL_TRAINER_STATE,
    OPTIMIZER_GROUPS_KEY,
    PARAM_ID_NAMES_KEY,
    WORLD_SIZE_KEY,
    CheckpointError,
    bytes_to_write,
    detect_format,
    local_engine,
    local_shard_name,
    read_local_metadata,
    readable,
    save_file,
    save_sharded,
)
from lightning_gaudi_fsdp.checkpoint.layout import join_rank_slices, unflatten
from lightning_gaudi_fsdp.checkpoint.trust import load_file, read_distributed, storage_reader
from lightning_gaudi_fsdp.checkpoint.views import (
    dcp_model_key,
    dcp_optimizer_key,
    fabric_layout,
    file_view,
    internal_view,
    is_fabric,
    sharded_view,
)
from lightning_gaudi_fsdp.engine.pieces import optimizer_state_by_name

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
    engine = rest.get(ENGINE_KEY)
    return {
        "engine": f"FSDP{engine}" if engine in (1, 2) else "unknown (not written by lightning-gaudi-fsdp)",
        "epoch": rest.get("epoch"),
        "global_step": rest.get("global_step"),
        "lightning_version": rest.get("pytorch-lightning_version"),
        "hf_model": json.loads(rest[HF_KEY]) if isinstance(rest.get(HF_KEY), str) else None,
        "layout": "fabric" if is_fabric(rest) else "trainer",
    }


def describe(path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
    """Format, writer's world size, parameter count and bytes, dtypes, optimizer presence, epoch/step, versions.
    ``world_size`` is None for a full file and where a sharded checkpoint has no record of it (written before it was
    recorded, or by ``convert``, whose single process writes for any world size).

    ``weights_only``: unpickle safely (see :mod:`.trust`); ``False`` only for a checkpoint whose source is trusted."""
    path = readable(path)
    fmt = detect_format(path)
    info: dict[str, Any] = {"path": str(path), "format": fmt}
    if fmt == "full":
        ckpt = file_view(load_file(path, path, "the checkpoint file", weights_only=weights_only), path)
        state = ckpt.get("state_dict", {})
        info.update(_tensor_summary(v for v in state.values() if isinstance(v, torch.Tensor)))
        info.update(world_size=None, optimizer=bool(ckpt.get("optimizer_states")), **_trainer_fields(ckpt))
    elif fmt == "sharded":
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = storage_reader(path, weights_only=weights_only).read_metadata()
        rest = sharded_view(path, metadata, weights_only)
        prefix = f"{dcp_model_key(rest)}."
        model = {
            k: md
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
        }
        meta_tensors = [torch.empty(md.size, dtype=md.properties.dtype, device="meta") for md in model.values()]
        info.update(_tensor_summary(meta_tensors))
        info.update(
            world_size=rest.get(WORLD_SIZE_KEY),  # None: not recorded (older checkpoints, convert's output)
            optimizer=any(not k.startswith(prefix) for k in metadata.state_dict_metadata),
            **_trainer_fields(rest),
        )
    else:
        meta = read_local_metadata(path)
        rest = internal_view(
            load_file(path / LOCAL_TRAINER_STATE, path, "the trainer state", weights_only=weights_only), path
        )
        if local_engine(meta) == 2:
            shapes = [(entry["shape"], entry["dtype"]) for entry in meta["parameters"]]
        else:
            shapes = [(shape, entry["dtype"]) for entry in meta["flat_params"] for shape in entry["shapes"]]
        tensors = [torch.empty(s, dtype=getattr(torch, d), device="meta") for s, d in shapes]
        info.update(_tensor_summary(tensors))
        shard0 = load_file(path / local_shard_name(0), path, "the shard of rank 0", weights_only=weights_only)
        info.update(
            world_size=meta["world_size"],
            optimizer=bool(shard0.get("optimizer_states")),
            sharding_strategy=meta.get("sharding_strategy"),
            fsdp_units=len(meta.get("fsdp_units", [])) if local_engine(meta) == 1 else None,
            **_trainer_fields(rest),
        )
        info["versions"] = meta.get("versions", {})
    return info


def load_full_state(
    path: str | os.PathLike[str], progress: Progress = _no_progress, *, weights_only: bool = True
) -> tuple[dict[str, Any], list[str]]:
    """Any format, in either layout (see :mod:`.views`), as one full checkpoint in the internal view (the Trainer's
    layout) in memory; returns it and notes about what was dropped.

    ``weights_only``: unpickle safely (see :mod:`.trust`); ``False`` only for a checkpoint whose source is trusted."""
    path = readable(path)
    fmt = detect_format(path)
    if fmt == "full":
        return file_view(load_file(path, path, "the checkpoint file", weights_only=weights_only), path), []
    if fmt == "sharded":
        return _sharded_to_full(path, weights_only), []
    return _local_to_full(path, progress, weights_only)


def _sharded_to_full(path: Path, weights_only: bool) -> dict[str, Any]:
    # DCP's own offline reader (what dcp_to_torch_save uses), loading straight into tensors it allocates from the
    # metadata: one copy of the checkpoint in memory, no temporary file read back.
    reader = storage_reader(path, weights_only=weights_only)
    rest = sharded_view(path, reader.read_metadata(), weights_only)
    state: dict[str, Any] = {}
    read_distributed(path, state, torch_internals.empty_load_planner(), weights_only=weights_only)
    rest.pop(OPTIMIZER_GROUPS_KEY, None)
    rest.pop(WORLD_SIZE_KEY, None)  # the writers of this checkpoint, not of what is made from it
    rest["state_dict"] = state.pop(dcp_model_key(rest))
    optimizers = []
    while (key := dcp_optimizer_key(rest, len(optimizers))) is not None and key in state:
        optimizers.append(state[key])
    if optimizers:
        rest["optimizer_states"] = optimizers
    return rest


def _local_to_full(path: Path, progress: Progress, weights_only: bool) -> tuple[dict[str, Any], list[str]]:
    meta = read_local_metadata(path)
    rest = internal_view(
        load_file(path / LOCAL_TRAINER_STATE, path, "the trainer state", weights_only=weights_only), path
    )
    if local_engine(meta) == 2:
        return _fsdp2_local_to_full(path, meta, rest, progress, weights_only)
    world_size = int(meta["world_size"])
    layout = meta["flat_params"]
    shards = []  # memory-mapped: the pages are read while assembling, one flat parameter at a time
    for rank in progress(range(world_size), "reading rank shards", world_size):
        shard = load_file(path / local_shard_name(rank), path, f"the shard of rank {rank}", weights_only=weights_only)
        missing = [entry["key"] for entry in layout if entry["key"] not in shard["model"]]
        if missing:
            raise CheckpointError(path, f"the shard of rank {rank} lacks {missing[0]!r}")
        shards.append(shard)
    flat_keys = {entry["key"] for entry in layout}
    state: dict[str, torch.Tensor] = {k: v for k, v in shards[0]["model"].items() if k not in flat_keys}
    for entry in progress(layout, "unflattening parameters", len(layout)):
        state.update(unflatten(join_rank_slices(shard["model"][entry["key"]] for shard in shards), entry))
    rest["state_dict"] = state
    join = functools.partial(_local_optimizer_to_full, layout=layout)
    return rest, _join_local_optimizers(rest, meta, [shard.get("optimizer_states") or [] for shard in shards], join)


def _join_local_optimizers(
    rest: dict[str, Any],
    meta: dict[str, Any],
    per_rank: list[list[dict[str, Any]]],
    join: Callable[[list[dict[str, Any]], list[str]], dict[str, Any]],
) -> list[str]:
    """Into ``rest``: each optimizer's state joined from the ranks' ``per_rank`` states by ``join(states, names)``
    (either engine's), keyed by the parameter names the local checkpoint records. Without those names the weights
    still convert: the optimizer state is left out, and the note returned (also kept in ``conversion_notes``) says
    so."""
    rest.pop("optimizer_states", None)
    if not per_rank[0]:
        return []
    names = meta.get("optimizer_param_names")
    if not isinstance(names, list) or len(names) != len(per_rank[0]):
        notes = ["this local checkpoint does not name its optimizer parameters; its optimizer state was not converted"]
        rest["conversion_notes"] = notes
        return notes
    rest["optimizer_states"] = [join([states[i] for states in per_rank], names[i]) for i in range(len(names))]
    return []


def _fsdp2_local_to_full(
    path: Path, meta: dict[str, Any], rest: dict[str, Any], progress: Progress, weights_only: bool
) -> tuple[dict[str, Any], list[str]]:
    """An FSDP2 local checkpoint: each parameter (and per-element optimizer state) is the concatenation along dim 0
    of the shards of the ranks of one replica, in rank order (the mesh's last dimension shards, ``torch.chunk``
    style; with hybrid sharding the first replica's ranks are read)."""
    layout = meta["parameters"]
    shard_ranks = int(layout[0]["mesh"][-1]) if layout and layout[0].get("mesh") else int(meta["world_size"])
    shards = [
        load_file(path / local_shard_name(rank), path, f"the shard of rank {rank}", weights_only=weights_only)
        for rank in progress(range(shard_ranks), "reading rank shards", shard_ranks)
    ]
    names = [entry["name"] for entry in layout]
    for rank, shard in enumerate(shards):
        missing = [name for name in names if name not in shard["model"]]
        if missing:
            raise CheckpointError(path, f"the shard of rank {rank} lacks {missing[0]!r}")
    state = {k: v for k, v in shards[0]["model"].items() if k not in set(names)}  # buffers: whole on every rank
    for name in names:
        state[name] = torch.cat([shard["model"][name] for shard in shards], dim=0)
    rest["state_dict"] = state
    per_rank = [shard.get("optimizer_states") or [] for shard in shards]
    return rest, _join_local_optimizers(rest, meta, per_rank, _fsdp2_optimizer_to_full)


def _fsdp2_optimizer_to_full(states: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    full: dict[int, dict[str, Any]] = {}
    for pid in range(len(names)):
        entries = [s["state"].get(pid, {}) for s in states]
        for key, first in entries[0].items():
            whole = first.dim() > 0 if isinstance(first, torch.Tensor) else False
            full.setdefault(pid, {})[key] = torch.cat([e[key] for e in entries], dim=0) if whole else first
    return optimizer_state_by_name({"state": full, "param_groups": states[0]["param_groups"]}, names)


def _local_optimizer_to_full(
    states: list[dict[str, Any]], names: list[str], layout: list[dict[str, Any]]
) -> dict[str, Any]:
    """Every rank's ``optimizer.state_dict()`` as one optimizer state keyed by parameter name (FSDP's full form).

    A per-element state tensor (``exp_avg``...) of a rank covers that rank's contiguous slice of the parameter (with
    ``use_orig_params=True``) or of the flat parameter (with ``False``): concatenated in rank order they are the whole,
    unflattened like the weights. Scalars (``step``) are the same on every rank."""
    flat_entries = {entry["key"]: entry for entry in layout}
    shapes = {
        join_name(e["prefix"], fqn): shape for e in layout for fqn, shape in zip(e["fqns"], e["shapes"], strict=True)
    }

    def fqns(name: str) -> list[str]:
        entry = flat_entries.get(name)
        return [join_name(entry["prefix"], fqn) for fqn in entry["fqns"]] if entry else [name]

    full: dict[str, dict[str, Any]] = {}
    for pid, name in enumerate(names):
        present = [s["state"][pid] for s in states if s["state"].get(pid)]  # ranks whose slice is empty hold none
        for key, first in present[0].items() if present else ():
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                whole = join_rank_slices(p[key] for p in present)
                if name in flat_entries:
                    pieces = unflatten(whole, flat_entries[name])
                else:
                    pieces = {name: whole[: math.prod(shapes[name])].reshape(shapes[name])}
            else:
                pieces = dict.fromkeys(fqns(name), first)
            for fqn, value in pieces.items():
                full.setdefault(fqn, {})[key] = value
    groups = [
        {**group, "params": [fqn for pid in group["params"] for fqn in fqns(names[pid])]}
        for group in states[0]["param_groups"]
    ]
    return {"state": full, "param_groups": groups}


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    to: Literal["full", "sharded"],
    progress: Progress = _no_progress,
    *,
    weights_only: bool = True,
    check_free_space: bool | None = None,
) -> list[str]:
    """Write ``src`` (any format) as ``dst`` in format ``to``, in ``src``'s layout (a Fabric checkpoint as Fabric's,
    a Trainer checkpoint as the Trainer's; see :mod:`.views`); ``dst`` appears only once complete. ``src`` is unpickled
    with ``weights_only`` (see :mod:`.trust`); ``False`` only for a checkpoint whose source is trusted. A write that
    fails, or free space short of the estimated output (checked first unless ``check_free_space`` is off, see
    :func:`~.space.check_free_space_enabled`), raises :class:`~.storage.CheckpointSaveError` naming the cause."""
    src, dst = files.locate(src, "src"), files.locate(dst, "dst")
    if to not in ("full", "sharded"):
        raise ValueError(f"to={to!r} is not supported; expected one of 'full', 'sharded'")
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination (nothing is overwritten)")
    verified: list[str] = []
    integrity.verify_offline(src, verified)  # before anything is read: damage raises CheckpointIntegrityError
    checkpoint, notes = load_full_state(src, progress, weights_only=weights_only)
    notes = verified + notes
    staging = commit.staging_path(dst, os.urandom(6).hex())
    if to == "full":
        if is_fabric(checkpoint):
            checkpoint = fabric_layout(checkpoint)
        write = lambda: save_file(checkpoint, staging, trailer=True)  # noqa: E731
    else:
        checkpoint = _sharded_from_full(checkpoint, notes)
        if is_fabric(checkpoint):
            checkpoint = fabric_layout(checkpoint)
        write = lambda: save_sharded(checkpoint, staging, rank=0, world_size=None, no_dist=True)  # noqa: E731
    recorder = checksum.Recorder(staging if to == "sharded" else staging.parent)  # the output carries checksums
    with checksum.recording(recorder):
        storage.write_atomically(
            dst,
            [write],
            directory=to == "sharded",
            needed=lambda: bytes_to_write(to, checkpoint, rank=0),
            check_free_space=check_free_space,
            staging=staging,
            recorder=recorder if to == "sharded" else None,
        )
    return notes


def _sharded_from_full(checkpoint: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The checkpoint for a single-process DCP save of the model and of the optimizer state, both keyed by parameter
    name; DCP reshards them on load to any world size."""
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
    return checkpoint
