"""Full, sharded and local state-dict checkpoints of an FSDP model: detect, check, save and load.

- ``full``: one ``torch.save`` file in Lightning's standard layout. Model weights are gathered on rank 0 under
  ``state_dict`` (plain names, no FSDP prefixes) and optimizer state is in torch's standard per-parameter-id form, so a
  plain PyTorch/Lightning program loads it without FSDP.
- ``sharded``: a directory in Lightning's distributed-checkpoint layout (torch DCP files plus ``meta.pt`` holding
  everything that is not a model or optimizer tensor). It loads at any world size.
- ``local``: a directory with one ``rank_NNNNN.pt`` per rank (that rank's slice of every flat parameter and its raw
  optimizer state), ``trainer_state.pt`` and ``local_metadata.json`` (world size, sharding strategy, wrap and
  flat-parameter layout, versions). Fastest to write; loads only at the same world size and wrapping.

Every save is staged and committed atomically (see :mod:`.commit`); the marker file of a directory format is written
last. This module knows nothing about Lightning or Gaudi: callers pass the model, optimizers, rank and a barrier.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.checkpoint import commit
from lightning_gaudi_fsdp.checkpoint.layout import FLAT_PARAM, _clean, flat_param_layout, fsdp_units

CheckpointFormat = Literal["full", "sharded", "local"]
SHARDED_METADATA = "meta.pt"  # Lightning's name: a folder with it is a sharded checkpoint to Lightning too
LOCAL_METADATA = "local_metadata.json"
LOCAL_TRAINER_STATE = "trainer_state.pt"
LOCAL_FORMAT_VERSION = 1
OPTIMIZER_GROUPS_KEY = "gaudi_fsdp_optimizer_param_groups"


def local_shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the path and the problem."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"Cannot load checkpoint {str(path)!r}: {problem}")
        self.path = Path(path)
        self.problem = problem


def detect_format(path: str | os.PathLike[str]) -> CheckpointFormat:
    path = Path(path)
    commit.recover(path)
    if path.is_file():
        return "full"
    if path.is_dir():
        if (path / LOCAL_METADATA).is_file():
            return "local"
        if (path / SHARDED_METADATA).is_file():
            return "sharded"
        if commit.staging_path(path).exists() or path.name.endswith(commit.PARTIAL_SUFFIX):
            raise CheckpointError(path, "the save was interrupted; the checkpoint was never committed")
        raise CheckpointError(
            path, f"the directory has neither {LOCAL_METADATA!r} (local) nor {SHARDED_METADATA!r} (sharded)"
        )
    if commit.staging_path(path).exists():
        raise CheckpointError(path, "the save was interrupted before it was committed; use an earlier checkpoint")
    raise CheckpointError(path, "no such file or directory")


# ---------------------------------------------------------------------------------------------------- contexts
def state_dict_context(
    model: Module, fmt: CheckpointFormat, device_type: str, rank0_only: bool = True
) -> AbstractContextManager:
    """FSDP's state-dict context for ``fmt``. Shards that already live on the CPU are not offloaded again: with
    ``offload_to_cpu=True`` torch 2.13 frees memory it still reads while building a full state dict on CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    offload = device_type != "cpu"
    if fmt == "full":
        configs: tuple[Any, Any, Any] = (
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        )
    elif fmt == "sharded":
        configs = (
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=offload),
            ShardedOptimStateDictConfig(offload_to_cpu=offload),
        )
    else:
        configs = (StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(), LocalOptimStateDictConfig())
    return FSDP.state_dict_type(model, *configs)


def _managed_names(model: Module) -> set[str]:
    return {f"{e['prefix']}.{f}" if e["prefix"] else f for e in flat_param_layout(model) for f in e["fqns"]}


# ---------------------------------------------------------------------------------------------- state extraction
def model_state_dict(model: Module, fmt: CheckpointFormat, device_type: str) -> dict[str, Any]:
    """The model's state in ``fmt`` (empty on ranks other than 0 for ``full``)."""
    with state_dict_context(model, fmt, device_type):
        state = model.state_dict()
    if fmt != "local":
        return state
    managed = _managed_names(model)
    local: dict[str, Any] = {}
    for key, value in state.items():
        if key.endswith(FLAT_PARAM):
            shards = value.local_shards()
            local[key] = shards[0].tensor.detach().cpu().clone() if shards else torch.empty(0)
        elif key not in managed:
            local[key] = value.detach().cpu().clone()
    return local


def optimizer_state_dict(
    model: Module, optimizer: Optimizer, fmt: CheckpointFormat, device_type: str, rank: int
) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    if fmt == "local":
        return optimizer.state_dict()
    with state_dict_context(model, fmt, device_type):
        state = FSDP.optim_state_dict(model, optimizer)
        if fmt == "full" and rank == 0 and getattr(model, "_use_orig_params", False):
            # torch's standard per-parameter-id form; with use_orig_params=False the parameters a plain optimizer
            # would see do not exist, so the state stays keyed by parameter name (both forms load here).
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model)
    return state


# ------------------------------------------------------------------------------------------------------- saving
def save(
    fmt: CheckpointFormat,
    checkpoint: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    local_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``checkpoint`` (with ``state_dict`` and ``optimizer_states`` in ``fmt``) atomically to ``path``.

    Every rank calls this. Nothing appears under ``path`` unless every rank finished writing."""
    path = Path(path)
    directory = fmt != "full"
    if rank == 0:
        if path.is_dir() and not directory and detect_format_or_none(path) is None:
            raise IsADirectoryError(f"Refusing to replace directory {str(path)!r} (not a checkpoint) with a file")
        commit.prepare_staging(path, directory)
    barrier()
    staging = commit.staging_path(path)
    try:
        if fmt == "full":
            if rank == 0:
                torch.save(checkpoint, staging)
        elif fmt == "sharded":
            _save_sharded(checkpoint, staging, rank)
        else:
            _save_local(checkpoint, staging, rank, world_size, local_metadata or {}, barrier)
    except BaseException:
        if rank == 0:
            commit.discard(path)
        raise
    barrier()
    if rank == 0:
        commit.commit(staging, path)
    barrier()
    return path


def detect_format_or_none(path: Path) -> CheckpointFormat | None:
    try:
        return detect_format(path)
    except CheckpointError:
        return None


def _split_state(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    rest = dict(checkpoint)
    model_state = rest.pop("state_dict", {})
    optimizer_states = rest.pop("optimizer_states", [])
    return model_state, optimizer_states, rest


def _save_sharded(checkpoint: dict[str, Any], staging: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_states, rest = _split_state(checkpoint)
    state = {"model": model_state, **{f"optimizer_{i}": s for i, s in enumerate(optimizer_states)}}
    dcp.save(state, checkpoint_id=staging)
    if rank == 0:
        # Kept beside Lightning's metadata for optimizers whose per-parameter state is empty.
        rest[OPTIMIZER_GROUPS_KEY] = [{"param_groups": s.get("param_groups", [])} for s in optimizer_states]
        torch.save(rest, staging / SHARDED_METADATA)


def _save_local(
    checkpoint: dict[str, Any],
    staging: Path,
    rank: int,
    world_size: int,
    metadata: Mapping[str, Any],
    barrier: Callable[[], None],
) -> None:
    model_state, optimizer_states, rest = _split_state(checkpoint)
    torch.save({"model": model_state, "optimizer_states": optimizer_states}, staging / local_shard_name(rank))
    barrier()
    if rank == 0:
        torch.save(rest, staging / LOCAL_TRAINER_STATE)
        missing = [r for r in range(world_size) if not (staging / local_shard_name(r)).is_file()]
        if missing:
            raise RuntimeError(f"local checkpoint: shards of ranks {missing} were not written to {staging}")
        meta = {"format": "local", "format_version": LOCAL_FORMAT_VERSION, "world_size": world_size, **metadata}
        # The marker is written last: a directory without it is never taken for a checkpoint.
        (staging / LOCAL_METADATA).write_text(json.dumps(meta, indent=2, sort_keys=True))


def local_metadata(model: Module, sharding_strategy: str, versions: Mapping[str, str]) -> dict[str, Any]:
    return {
        "sharding_strategy": sharding_strategy,
        "fsdp_units": fsdp_units(model),
        "flat_params": flat_param_layout(model),
        "versions": dict(versions),
    }


def read_local_metadata(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / LOCAL_METADATA).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(path, f"{LOCAL_METADATA} is unreadable ({err})") from err


def _torch_load(file: Path, where: Path, what: str, weights_only: bool = False) -> Any:
    if not file.is_file():
        raise CheckpointError(where, f"{what} is missing ({file.name})")
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only, mmap=True)
    except Exception as err:
        raise CheckpointError(where, f"{what} ({file.name}) is damaged or truncated: {err}") from err


# ------------------------------------------------------------------------------------------------------ checking
def expected_full_shapes(model: Module) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters a full state dict of ``model`` must hold."""
    shapes = {
        (f"{e['prefix']}.{f}" if e["prefix"] else f): tuple(s)
        for e in flat_param_layout(model)
        for f, s in zip(e["fqns"], e["shapes"], strict=True)
    }
    from torch.distributed.fsdp._flat_param import FlatParameter

    for name, param in model.named_parameters():
        clean = _clean(name)
        if not isinstance(param, FlatParameter) and clean not in shapes:
            shapes[clean] = tuple(param.shape)
    return shapes


def check_state_keys(
    path: Path, saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], strict: bool
) -> None:
    missing = sorted(set(expected) - set(saved))
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


def check_sharded(path: Path, model_state: Mapping[str, Any], strict: bool) -> Any:
    """Read and check the DCP metadata against ``model_state`` (a sharded state dict); returns the metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise CheckpointError(path, f"the distributed-checkpoint metadata (.metadata) is unreadable: {err}") from err
    for info in metadata.storage_data.values():
        file = path / info.relative_path
        if not file.is_file():
            raise CheckpointError(path, f"shard file {info.relative_path!r} is missing")
        if file.stat().st_size < info.offset + info.length:
            raise CheckpointError(path, f"shard file {info.relative_path!r} is truncated")
    saved = {
        key.removeprefix("model."): tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    expected = {k: tuple(v.size()) for k, v in model_state.items() if hasattr(v, "size")}
    check_state_keys(path, saved, expected, strict)
    return metadata


def check_local(path: Path, model: Module, world_size: int, rank: int) -> dict[str, Any]:
    meta = read_local_metadata(path)
    if meta.get("world_size") != world_size:
        raise CheckpointError(
            path,
            f"this local checkpoint was saved with world size {meta.get('world_size')} and this run has world size "
            f"{world_size}; a local checkpoint only loads at the world size that wrote it. Convert it with "
            f"`lightning-gaudi-fsdp convert {path} OUT --to sharded` to load it at another size",
        )
    current = flat_param_layout(model)
    saved_units = [(e["key"], e["fqns"], e["shapes"]) for e in meta.get("flat_params", [])]
    if saved_units != [(e["key"], e["fqns"], e["shapes"]) for e in current]:
        raise CheckpointError(
            path,
            "its FSDP wrap layout differs from this model's (another model, auto_wrap_policy or use_orig_params); "
            f"saved units {meta.get('fsdp_units')} vs current {fsdp_units(model)}",
        )
    return meta


# ------------------------------------------------------------------------------------------------------- loading
@dataclass
class PendingLoad:
    """A checkpoint that passed every check on this rank; :func:`apply_load` changes the weights."""

    fmt: CheckpointFormat
    path: Path
    rest: dict[str, Any]
    model_state: dict[str, Any] = field(default_factory=dict)
    optimizer_states: list[Any] | None = None
    dcp_metadata: Any = None


def check_load(
    path: str | os.PathLike[str], model: Module, *, world_size: int, rank: int, device_type: str, strict: bool
) -> PendingLoad:
    """Detect the format of ``path``, read what this rank needs and check it against ``model`` and the world size.
    Raises :class:`CheckpointError`; nothing in ``model`` is changed.

    Building a sharded or local state dict runs collectives, so it happens before any check that could fail on one
    rank only: every rank reaches the caller's agreement step having run the same collectives."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt in ("sharded", "local"):
        with state_dict_context(model, fmt, device_type):
            current = model.state_dict()
    if fmt == "full":
        checkpoint = _torch_load(path, path, "the checkpoint file")
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise CheckpointError(path, "it has no 'state_dict' entry; it is not a Lightning checkpoint")
        state = checkpoint.pop("state_dict")
        saved = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        check_state_keys(path, saved, expected_full_shapes(model), strict)
        return PendingLoad(fmt, path, checkpoint, state, checkpoint.pop("optimizer_states", None))
    if fmt == "sharded":
        rest = _torch_load(path / SHARDED_METADATA, path, "the trainer state")
        metadata = check_sharded(path, current, strict)
        return PendingLoad(fmt, path, rest, current, dcp_metadata=metadata)
    check_local(path, model, world_size, rank)
    rest = _torch_load(path / LOCAL_TRAINER_STATE, path, "the trainer state")
    shard = _torch_load(path / local_shard_name(rank), path, f"the shard of rank {rank}")
    if not isinstance(shard, dict) or "model" not in shard:
        raise CheckpointError(path, f"the shard of rank {rank} holds no model state")
    missing = [k for k in current if k.endswith(FLAT_PARAM) and k not in shard["model"]]
    if missing:
        raise CheckpointError(path, f"the shard of rank {rank} lacks {missing[:3]}")
    return PendingLoad(fmt, path, rest, shard["model"], shard.get("optimizer_states"))


def apply_load(
    pending: PendingLoad,
    model: Module,
    optimizers: Sequence[Optimizer],
    *,
    device_type: str,
    strict: bool,
    load_optimizers: bool,
) -> dict[str, Any]:
    """Load the checked state into ``model`` (and ``optimizers``); returns the remaining trainer state."""
    path, rest = pending.path, pending.rest
    if pending.fmt == "full":
        with state_dict_context(model, "full", device_type, rank0_only=False):
            model.load_state_dict(pending.model_state, strict=strict)
        if load_optimizers and pending.optimizer_states is not None:
            _check_optimizer_count(path, pending.optimizer_states, optimizers)
            _load_full_optimizers(model, optimizers, pending.optimizer_states, device_type)
    elif pending.fmt == "sharded":
        _load_sharded(pending, model, optimizers, device_type, strict, load_optimizers)
    else:
        _load_local(pending, model, device_type)
        if load_optimizers and pending.optimizer_states is not None:
            _check_optimizer_count(path, pending.optimizer_states, optimizers)
            for optimizer, state in zip(optimizers, pending.optimizer_states, strict=True):
                optimizer.load_state_dict(state)
    return rest


def _check_optimizer_count(path: Path, states: Sequence[Any], optimizers: Sequence[Optimizer]) -> None:
    if len(states) != len(optimizers):
        raise CheckpointError(path, f"it holds {len(states)} optimizer state(s); this run has {len(optimizers)}")


def _load_full_optimizers(
    model: Module, optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]], device_type: str
) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    for optimizer, state in zip(optimizers, states, strict=True):
        if not state.get("state"):
            # Nothing to shard (e.g. SGD without momentum): the hyper-parameters are all there is.
            optimizer.load_state_dict({"state": {}, "param_groups": _merge_groups(optimizer, state)})
            continue
        if isinstance(next(iter(state["state"])), int):
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, model)
        with state_dict_context(model, "full", device_type, rank0_only=False):
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state))


def _merge_groups(optimizer: Optimizer, state: Mapping[str, Any]) -> list[dict[str, Any]]:
    current = optimizer.state_dict()["param_groups"]
    return [{**saved, "params": cur["params"]} for saved, cur in zip(state["param_groups"], current, strict=True)]


def _load_sharded(
    pending: PendingLoad,
    model: Module,
    optimizers: Sequence[Optimizer],
    device_type: str,
    strict: bool,
    load_optimizers: bool,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    path, keys = pending.path, set(pending.dcp_metadata.state_dict_metadata)
    groups = pending.rest.pop(OPTIMIZER_GROUPS_KEY, [])
    with state_dict_context(model, "sharded", device_type):
        state = {"model": pending.model_state}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"], strict=strict)
        if not load_optimizers or not any(k.startswith("optimizer_") for k in keys):
            return  # a weights-only checkpoint
        reader = dcp.FileSystemReader(str(path))
        for idx, optimizer in enumerate(optimizers):
            key = f"optimizer_{idx}"
            if not any(k.startswith(f"{key}.") for k in keys):
                raise CheckpointError(path, f"it holds no state for optimizer {idx}")
            if not any(k.startswith(f"{key}.state.") for k in keys):
                # No per-parameter state (e.g. SGD without momentum): restore the hyper-parameters we stored.
                if idx < len(groups):
                    optimizer.load_state_dict({"state": {}, "param_groups": _merge_groups(optimizer, groups[idx])})
                continue
            loaded = load_sharded_optimizer_state_dict(state["model"], key, reader)[key]
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, loaded))


def _load_local(pending: PendingLoad, model: Module, device_type: str) -> None:
    with state_dict_context(model, "local", device_type), torch.no_grad():
        current = model.state_dict()
        for key, value in pending.model_state.items():
            if key.endswith(FLAT_PARAM):
                local_shards = current[key].local_shards()
                if local_shards:
                    local_shards[0].tensor.copy_(value)
            else:
                current[key] = value
        model.load_state_dict(current, strict=False)
