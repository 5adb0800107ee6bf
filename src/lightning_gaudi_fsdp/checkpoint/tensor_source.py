"""A checkpoint's model tensors read a few at a time: names, shapes and dtypes first, then any subset on demand.

Offline exports that stream (one output file in memory at a time, not the model) read through this. Every format is
opened without materialising the weights: a full file and local rank shards are memory-mapped (``torch.load``
with ``mmap=True``, so only the pages of the tensors asked for are read), a sharded (DCP) checkpoint reads only the
byte ranges of the requested tensors. A local FSDP1 checkpoint joins one flat parameter (one FSDP unit) at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_fsdp.adapters.fsdp1_internals import join_name
from lightning_gaudi_fsdp.checkpoint.formats import (
    LOCAL_TRAINER_STATE,
    CheckpointError,
    detect_format,
    local_engine,
    local_shard_name,
    read_local_metadata,
    readable,
)
from lightning_gaudi_fsdp.checkpoint.layout import join_rank_slices, unflatten
from lightning_gaudi_fsdp.checkpoint.trust import load_file, read_distributed, storage_reader
from lightning_gaudi_fsdp.checkpoint.views import dcp_model_key, internal_view, sharded_view


@dataclass
class TensorSource:
    """``entries``: every model tensor's name (as in the checkpoint's ``state_dict``) -> (shape, dtype), in the
    checkpoint's order; ``rest``: the trainer state saved beside the weights (epoch, step, hyper-parameters...)."""

    path: Path
    fmt: str
    entries: dict[str, tuple[torch.Size, torch.dtype]]
    rest: dict[str, Any]
    _weights_only: bool = True
    _full: dict[str, torch.Tensor] = field(default_factory=dict)  # a full checkpoint's (memory-mapped) state dict
    _shards: list[dict[str, Any]] = field(default_factory=list)  # a local checkpoint's (memory-mapped) rank files
    _layout: list[dict[str, Any]] = field(default_factory=list)  # its FSDP1 flat parameters
    _owner: dict[str, str] = field(default_factory=dict)  # local: parameter name -> the key its shards are under
    _engine: int = 1
    _reader: Any = None  # a sharded checkpoint's reader, its metadata read once for every tensor

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (each its own storage or a memory-mapped view); unknown names raise."""
        names = list(names)
        unknown = [n for n in names if n not in self.entries]
        if unknown:
            raise CheckpointError(self.path, f"it holds no model tensor {unknown[0]!r}")
        if self.fmt == "full":
            return {n: self._full[n] for n in names}
        if self.fmt == "sharded":
            return self._read_sharded(names)
        if self._engine == 2:
            return {n: self._read_fsdp2_local(n) for n in names}
        return self._read_fsdp1_local(names)

    def group(self, name: str) -> list[str]:
        """The tensors that :meth:`read` gets at the cost of ``name`` alone: every parameter of its flat parameter
        (one FSDP unit) in a local FSDP1 checkpoint, else just ``name``. A reader going tensor by tensor reads each
        group once."""
        owner = self._owner.get(name) if self.fmt == "local" and self._engine == 1 else None
        if owner is None:
            return [name]
        return [n for n, key in self._owner.items() if key == owner]

    def _read_sharded(self, names: list[str]) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        model = {n: torch.empty(self.entries[n][0], dtype=self.entries[n][1]) for n in names}
        planner = DefaultLoadPlanner()
        key = dcp_model_key(self.rest)
        read_distributed(self.path, {key: model}, planner, weights_only=self._weights_only, reader=self._reader)
        return model

    def _read_fsdp2_local(self, name: str) -> torch.Tensor:
        if name in self._owner:
            return torch.cat([shard["model"][name] for shard in self._shards], dim=0)
        return self._shards[0]["model"][name]  # buffers: whole on every rank

    def _read_fsdp1_local(self, names: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for entry in self._layout:
            wanted = [n for n in names if self._owner.get(n) == entry["key"]]
            if wanted:
                whole = unflatten(join_rank_slices(s["model"][entry["key"]] for s in self._shards), entry)
                out.update((n, whole[n]) for n in wanted)
        out.update((n, self._shards[0]["model"][n]) for n in names if n not in self._owner)
        return {n: out[n] for n in names}


def open_source(path: str | os.PathLike[str], *, weights_only: bool = True) -> TensorSource:
    """Open a full, sharded or local checkpoint (either engine, any writer world size) for :meth:`TensorSource.read`.

    ``weights_only``: unpickle safely (see :mod:`.trust`); ``False`` only for a checkpoint whose source is trusted."""
    path = readable(path)
    fmt = detect_format(path)
    if fmt == "full":
        from lightning_gaudi_fsdp.checkpoint.loading import split_model_state

        ckpt = load_file(path, path, "the checkpoint file", weights_only=weights_only)
        model_state, ckpt = split_model_state(path, ckpt, raw=False)
        state = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
        entries = {k: (v.shape, v.dtype) for k, v in state.items()}
        return TensorSource(path, fmt, entries, ckpt, weights_only, _full=state)
    if fmt == "sharded":
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = storage_reader(path, weights_only=weights_only)
        metadata = reader.read_metadata()
        rest = sharded_view(path, metadata, weights_only)
        prefix = f"{dcp_model_key(rest)}."
        entries = {
            k.removeprefix(prefix): (md.size, md.properties.dtype)
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
        }
        return TensorSource(path, fmt, entries, rest, weights_only, _reader=reader)
    return _open_local(path, weights_only)


def _open_local(path: Path, weights_only: bool) -> TensorSource:
    meta = read_local_metadata(path)
    rest = internal_view(
        load_file(path / LOCAL_TRAINER_STATE, path, "the trainer state", weights_only=weights_only), path
    )
    engine2 = local_engine(meta) == 2
    if engine2:
        layout = meta["parameters"]
        ranks = int(layout[0]["mesh"][-1]) if layout and layout[0].get("mesh") else int(meta["world_size"])
        managed = {e["name"]: e["name"] for e in layout}
        entries = {e["name"]: (torch.Size(e["shape"]), getattr(torch, e["dtype"])) for e in layout}
    else:
        ranks = int(meta["world_size"])
        managed = {join_name(e["prefix"], f): e["key"] for e in meta["flat_params"] for f in e["fqns"]}
        entries = {
            join_name(e["prefix"], f): (torch.Size(s), getattr(torch, e["dtype"]))
            for e in meta["flat_params"]
            for f, s in zip(e["fqns"], e["shapes"], strict=True)
        }
    shards = [
        load_file(path / local_shard_name(r), path, f"the shard of rank {r}", weights_only=weights_only)
        for r in range(ranks)
    ]
    needed = set(managed.values())
    for rank, shard in enumerate(shards):
        missing = sorted(needed - set(shard.get("model", {})))
        if missing:
            raise CheckpointError(path, f"the shard of rank {rank} lacks {missing[0]!r}")
    for key, value in shards[0]["model"].items():  # buffers and unmanaged parameters, whole on rank 0
        if key not in needed and key not in entries and isinstance(value, torch.Tensor):
            entries[key] = (value.shape, value.dtype)
    layout = [] if engine2 else meta["flat_params"]
    return TensorSource(
        path,
        "local",
        entries,
        rest,
        weights_only,
        _shards=shards,
        _layout=layout,
        _owner=managed,
        _engine=2 if engine2 else 1,
    )
