"""FSDP1 sharded state dicts built from each rank's own flat-parameter slices, with no collective.

torch's ``SHARDED_STATE_DICT`` for ``FullyShardedDataParallel`` all-gathers every flat parameter, and its sharded
optimizer state dict all-gathers every original parameter's state, only to cut each tensor again into dim-0 chunks
(with ``use_orig_params=True`` this dominated a sharded save). A rank already holds a contiguous range of each flat
parameter, and the same range of its optimizer state: in each original parameter that range is a run of elements in
row-major order, which is a union of at most ``2 * ndim - 1`` rectangular boxes. Here those boxes, views of the live
tensors, become the local shards of a ``ShardedTensor`` of the parameter's full shape, under the keys torch uses.

DCP stores each chunk's offsets and sizes and, on load, reads whatever overlaps the target's chunks: the checkpoint
loads as torch's own does (Lightning's ``FSDPStrategy``, any world size, either engine). Only the chunk boundaries
in the files differ. Every rank computes every rank's boxes from the flat-parameter layout, so no metadata is
exchanged; its own boxes are checked against FSDP's record of its shard.

:func:`supported` says when this applies (a sharded strategy over the default group, no device mesh); callers use
torch's path otherwise. Nothing is copied: a synchronous save writes the live tensors, an asynchronous one stages
them first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.nn import Module
from torch.optim import Optimizer


class Box(NamedTuple):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def row_major_boxes(shape: tuple[int, ...], start: int, end: int) -> tuple[Box, ...]:
    """The rectangular boxes that together hold elements ``[start, end)`` of a tensor of ``shape`` in row-major
    order, in that order (each box is a contiguous run of those elements)."""
    if end <= start:
        return ()
    if len(shape) == 1:
        return (Box((start,), (end - start,)),)
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    boxes: list[Box] = []
    if start % row or first == last:  # a partial first row (or everything within one row)
        inner = row_major_boxes(shape[1:], start - first * row, min(end, (first + 1) * row) - first * row)
        boxes += [Box((first, *b.offsets), (1, *b.sizes)) for b in inner]
        if first == last:
            return tuple(boxes)
        first += 1
    full_end = last + 1 if end % row == 0 else last
    if full_end > first:
        boxes.append(Box((first, *(0,) * (len(shape) - 1)), (full_end - first, *shape[1:])))
    if end % row:
        inner = row_major_boxes(shape[1:], 0, end - last * row)
        boxes += [Box((last, *b.offsets), (1, *b.sizes)) for b in inner]
    return tuple(boxes)


@dataclass(frozen=True)
class _Param:
    """One original parameter of a flat parameter, and where every rank's slice of it lies."""

    fqn: str  # clean, full name, as state dicts spell it
    shape: tuple[int, ...]
    boxes: tuple[tuple[Box, ...], ...]  # per rank: the boxes of the parameter that rank holds, in flat order
    offset_in_shard: int  # this rank's first element of the parameter within its local flat shard
    numel_in_shard: int


@dataclass(frozen=True)
class _Unit:
    flat_param: Any
    local: torch.Tensor  # this rank's shard of the flat parameter (padded)
    params: tuple[_Param, ...]
    orig_params: tuple[Any, ...]  # with use_orig_params: the original parameters, as the optimizer sees them


def supported(model: Module) -> bool:
    """Whether every FSDP unit of ``model`` shards its flat parameter over the whole default group (FULL_SHARD or
    SHARD_GRAD_OP, no device mesh), with parameters of at least one dimension and one element."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    if not (dist.is_available() and dist.is_initialized()):
        return False
    for module in model.modules():
        if not isinstance(module, FSDP):
            continue
        if module.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            return False
        if getattr(module, "_device_mesh", None) is not None or module.world_size != dist.get_world_size():
            return False
        handle = module._handle
        if handle is not None and any(len(s) == 0 or math.prod(s) == 0 for s in handle.flat_param._shapes):
            return False
    return True


def _units(model: Module) -> Iterator[_Unit]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_gaudi_fsdp.checkpoint.layout import _clean, _join

    for name, module in model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        flat = module._handle.flat_param
        world_size, rank = module.world_size, module.rank
        local = flat._local_shard if hasattr(flat, "_local_shard") else flat.data
        numels = list(getattr(flat, "_numels_with_padding", None) or flat._numels)
        padding = list(getattr(flat, "_is_padding_mask", None) or [False] * len(numels))
        total = flat._unpadded_unsharded_size.numel()
        chunk = math.ceil(total / world_size)  # FSDP cuts the flat parameter as torch.chunk does
        ranges = [(min(r * chunk, total), min((r + 1) * chunk, total)) for r in range(world_size)]
        params: list[_Param] = []
        start = 0
        originals = iter(zip(flat._fqns, flat._shapes, flat._shard_param_infos, strict=True))
        for numel, is_padding in zip(numels, padding, strict=True):
            end = start + numel
            if not is_padding:
                fqn, shape, info = next(originals)
                boxes = tuple(
                    row_major_boxes(tuple(shape), max(a, start) - start, min(b, end) - start) for a, b in ranges
                )
                own_start = max(ranges[rank][0], start) - ranges[rank][0]
                own_numel = max(0, min(ranges[rank][1], end) - max(ranges[rank][0], start))
                if own_numel != (info.numel_in_shard or 0) or (own_numel and own_start != info.offset_in_shard):
                    raise RuntimeError(f"{fqn}: FSDP's shard of this parameter is not where the flat layout puts it")
                params.append(_Param(_join(_clean(name), fqn), tuple(shape), boxes, own_start, own_numel))
            start = end
        yield _Unit(flat, local.detach(), tuple(params), tuple(getattr(flat, "_params", None) or ()))


def _sharded_tensor(param: _Param, flat_slice: torch.Tensor) -> Any:
    """The parameter-shaped ``ShardedTensor`` whose local shards are views of ``flat_slice`` (this rank's elements of
    the parameter, in flat order)."""
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    device = str(flat_slice.device)
    rank = dist.get_rank()
    metadata = {
        (r, box): ShardMetadata(
            shard_offsets=list(box.offsets), shard_sizes=list(box.sizes), placement=f"rank:{r}/{device}"
        )
        for r, boxes in enumerate(param.boxes)
        for box in boxes
    }
    local, position = [], 0
    for box in param.boxes[rank]:
        numel = math.prod(box.sizes)
        local.append(Shard(flat_slice[position : position + numel].view(box.sizes), metadata[(rank, box)]))
        position += numel
    properties = TensorProperties(dtype=flat_slice.dtype, requires_grad=False)
    global_metadata = ShardedTensorMetadata(list(metadata.values()), torch.Size(param.shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_metadata)


def model_state_dict(model: Module, rest: dict[str, Any]) -> dict[str, Any]:
    """The sharded model state dict: one ``ShardedTensor`` per original parameter, then ``rest`` (buffers and
    parameters FSDP does not manage, as a local state dict holds them)."""
    state: dict[str, Any] = {}
    for unit in _units(model):
        for param in unit.params:
            flat_slice = unit.local[param.offset_in_shard : param.offset_in_shard + param.numel_in_shard]
            state[param.fqn] = _sharded_tensor(param, flat_slice)
    state.update(rest)
    return state


def optimizer_state_dict(model: Module, optimizer: Optimizer) -> dict[str, Any] | None:
    """The sharded optimizer state dict, keyed by parameter name as ``FSDP.optim_state_dict`` keys it; ``None`` when
    the optimizer holds state this module cannot place (a tensor that is neither a scalar nor shaped like the
    parameter's shard): the caller then asks torch."""
    from lightning_gaudi_fsdp.checkpoint.layout import _clean

    names: dict[int, list[str]] = {}  # id(parameter the optimizer sees) -> the original names it stands for
    state: dict[str, Any] = {}
    for unit in _units(model):
        if unit.orig_params:
            for param, orig in zip(unit.params, unit.orig_params, strict=True):
                names[id(orig)] = [param.fqn]
                placed = _place(optimizer.state.get(orig), param, lambda t: t)
                if placed is None:
                    return None
                if placed:
                    state[param.fqn] = placed
            continue
        names[id(unit.flat_param)] = [param.fqn for param in unit.params]
        flat_state = optimizer.state.get(unit.flat_param)
        for param in unit.params:
            start, numel = param.offset_in_shard, param.numel_in_shard
            placed = _place(flat_state, param, lambda t, start=start, numel=numel: t[start : start + numel], unit.local)
            if placed is None:
                return None
            if placed:
                state[param.fqn] = placed
    for name, param in model.named_parameters():
        if id(param) not in names:  # not managed by FSDP (ignored): its state is the whole tensor on every rank
            names[id(param)] = [_clean(name)]
            if param in optimizer.state:
                state[_clean(name)] = dict(optimizer.state[param])
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [fqn for p in group["params"] for fqn in names.get(id(p), [])]})
    return {"state": state, "param_groups": groups}


def _place(
    values: dict[str, Any] | None, param: _Param, local_slice: Any, flat: torch.Tensor | None = None
) -> dict[str, Any] | None:
    """One parameter's optimizer state with its shaped tensors made ``ShardedTensor`` s; ``{}`` without state."""
    if not values:
        return {}
    expected = param.numel_in_shard if flat is None else flat.numel()
    placed: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            placed[key] = value
        elif value.dim() == 1 and value.numel() == expected:
            placed[key] = _sharded_tensor(param, local_slice(value.detach()))
        else:
            return None
    return placed
