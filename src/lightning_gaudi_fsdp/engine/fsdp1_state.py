"""FSDP1 sharded and full state dicts built from each rank's own flat-parameter slices.

torch's ``SHARDED_STATE_DICT`` for ``FullyShardedDataParallel`` all-gathers every flat parameter, and its sharded
optimizer state dict all-gathers every original parameter's state, only to cut each tensor again into dim-0 chunks
(with ``use_orig_params=True`` this dominated a sharded save). A rank already holds a contiguous range of each flat
parameter, and the same range of its optimizer state: in each original parameter that range is a run of elements in
row-major order, which is a union of at most ``2 * ndim - 1`` rectangular boxes. Here those boxes, views of the live
tensors, become the local shards of a ``ShardedTensor`` of the parameter's full shape, under the keys torch uses, with
no collective.

DCP stores each chunk's offsets and sizes and, on load, reads whatever overlaps the target's chunks: the checkpoint
loads as torch's own does (Lightning's ``FSDPStrategy``, any world size, either engine). Only the chunk boundaries
in the files differ. Every rank computes every rank's boxes from the flat-parameter layout, so no metadata is
exchanged; its own boxes are checked against FSDP's record of its shard.

Full state dicts: each rank sends its piece of each parameter (and of its optimizer state) straight into a tensor of
full shape on rank 0, where torch all-gathers every flat parameter on every rank and clones each parameter out.

:func:`supported` / :func:`supports_full` say when this applies (a sharded strategy over the default group, no device
mesh; for full, shards in host memory); callers use torch's path otherwise. Loading also serves NO_SHARD units
(:func:`loadable`), whose every rank holds the whole flat parameter. Sharded state dicts copy nothing: a
synchronous save writes the live tensors, an asynchronous one stages them first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.adapters import fsdp1_internals, torch_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name, join_name
from lightning_gaudi_fsdp.engine.pieces import carries_host_tensors, chunk_spans, gather_pieces, param_groups_by_id

if TYPE_CHECKING:
    from lightning_gaudi_fsdp.checkpoint.streaming import FullStream


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
    spans: tuple[tuple[int, int], ...]  # per rank: the elements [start, end) of the flattened parameter it holds
    offset_in_shard: int  # this rank's first element of the parameter within its local flat shard
    numel_in_shard: int
    replicated: bool  # NO_SHARD: every rank holds the whole parameter (and its optimizer state) in its own shape

    @property
    def state_shape(self) -> tuple[int, ...]:
        """The shape of this rank's optimizer state of the parameter with ``use_orig_params``: the parameter's own
        in NO_SHARD (FSDP keeps the original views), else the flat run of elements this rank holds."""
        return self.shape if self.replicated else (self.numel_in_shard,)


@dataclass(frozen=True)
class _Unit:
    flat_param: Any
    local: torch.Tensor  # this rank's shard of the flat parameter (padded)
    params: tuple[_Param, ...]
    orig_params: tuple[Any, ...]  # with use_orig_params: the original parameters, as the optimizer sees them


def supported(model: Module) -> bool:
    """Whether every FSDP unit of ``model`` shards its flat parameter over the whole default group (FULL_SHARD or
    SHARD_GRAD_OP, no device mesh), with parameters of at least one dimension and one element: the package then saves
    sharded and full state itself."""
    return _covers(model, replicated=False)


def loadable(model: Module) -> bool:
    """Whether :mod:`..checkpoint.fast_load` can place a sharded checkpoint's pieces into ``model``: as
    :func:`supported`, and NO_SHARD units too (FSDP1 turns every sharding strategy into NO_SHARD at world size 1)
    whose flat parameter is the whole, unpadded flat tensor: each rank then reads every element. Saves keep to
    :func:`supported` (from such a unit every rank would write every element). The same on every rank: it reads
    the wrap, the strategies and the layout only."""
    return _covers(model, replicated=True)


def _covers(model: Module, *, replicated: bool) -> bool:
    import torch.distributed as dist
    from torch.distributed.fsdp import ShardingStrategy

    if not (dist.is_available() and dist.is_initialized()):
        return False
    for module in model.modules():
        if not isinstance(module, fsdp1_internals.fsdp_class()):
            continue
        unit = fsdp1_internals.view(module)
        if module.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and not (
            replicated and module.sharding_strategy == ShardingStrategy.NO_SHARD and (unit is None or _whole(unit))
        ):
            return False
        if fsdp1_internals.device_mesh(module) is not None or module.world_size != dist.get_world_size():
            return False
        if unit is not None and any(len(s) == 0 or math.prod(s) == 0 for s in unit.shapes):
            return False
    # every parameter is in a unit found here, or ignored by FSDP (then it is saved whole, as torch saves it)
    covered = {id(p) for p in fsdp1_internals.ignored_parameters(model)}
    for unit in units(model):
        covered.add(id(unit.flat_param))
        covered.update(id(p) for p in unit.orig_params)
    return all(id(p) in covered for p in model.parameters())


def _whole(unit: fsdp1_internals.UnitView) -> bool:
    """Whether a unit that does not shard holds its whole flat parameter, unpadded (torch's ``FlatParamHandle.shard``
    gives such a unit the shard ``[0, numel)``)."""
    return not unit.uses_sharded_strategy and not unit.shard_padding and unit.local_shard.numel() == unit.unpadded_numel


flat_params = fsdp1_internals.flat_params  # the engine's name for it (``FSDP1.held_elements``)


def units(model: Module) -> Iterator[_Unit]:
    for view in fsdp1_internals.units(model):
        replicated = not view.uses_sharded_strategy  # NO_SHARD: every rank holds all of it
        spans_of_ranks = (
            ((0, view.unpadded_numel),) * view.world_size
            if replicated
            else chunk_spans(view.unpadded_numel, view.world_size)  # FSDP cuts the flat parameter so
        )
        own_range = spans_of_ranks[view.rank]
        params: list[_Param] = []
        start = 0
        originals = iter(zip(view.fqns, view.shapes, view.shard_infos, strict=True))
        for numel, is_padding in zip(view.numels_with_padding, view.is_padding_mask, strict=True):
            end = start + numel
            if not is_padding:
                fqn, shape, info = next(originals)
                spans = tuple((max(a, start) - start, max(a, start, min(b, end)) - start) for a, b in spans_of_ranks)
                boxes = tuple(row_major_boxes(shape, lo, hi) for lo, hi in spans)
                own_start = max(own_range[0], start) - own_range[0]
                own_numel = max(0, min(own_range[1], end) - max(own_range[0], start))
                if own_numel != info.numel_in_shard or (own_numel and own_start != info.offset_in_shard):
                    raise RuntimeError(f"{fqn}: FSDP's shard of this parameter is not where the flat layout puts it")
                params.append(_Param(join_name(view.name, fqn), shape, boxes, spans, own_start, own_numel, replicated))
            start = end
        yield _Unit(view.flat_param, view.local_shard.detach(), tuple(params), view.orig_params)


def _sharded_tensor(param: _Param, flat_slice: torch.Tensor) -> Any:
    """The parameter-shaped ``ShardedTensor`` whose local shards are views of ``flat_slice`` (this rank's elements of
    the parameter, in flat order). A replicated parameter's names this rank alone as its holder (shards may not
    overlap): a template to load into, which no save writes (see :func:`loadable`)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    local = [piece for _, piece in local_pieces(param, flat_slice, rank)]
    holders = [rank] if param.replicated else range(len(param.boxes))
    boxes = [(r, box.offsets, box.sizes) for r in holders for box in param.boxes[r]]
    return torch_internals.sharded_tensor(param.shape, flat_slice.dtype, str(flat_slice.device), boxes, local)


def local_pieces(param: _Param, flat_slice: torch.Tensor, rank: int) -> list[tuple[Box, torch.Tensor]]:
    """``rank``'s boxes of ``param`` and, for each, its view of ``flat_slice`` (that rank's elements of the parameter,
    in flat order) in the box's shape."""
    pieces, position = [], 0
    for box in param.boxes[rank]:
        numel = math.prod(box.sizes)
        pieces.append((box, flat_slice[position : position + numel].view(box.sizes)))
        position += numel
    return pieces


def model_state_dict(model: Module, rest: dict[str, Any]) -> dict[str, Any]:
    """The sharded model state dict: one ``ShardedTensor`` per original parameter, then ``rest`` (buffers and
    parameters FSDP does not manage, as a local state dict holds them)."""
    state: dict[str, Any] = {}
    for unit in units(model):
        for param in unit.params:
            flat_slice = unit.local[param.offset_in_shard : param.offset_in_shard + param.numel_in_shard]
            state[param.fqn] = _sharded_tensor(param, flat_slice)
    state.update(_buffers_in_their_dtype(model, {k: v for k, v in rest.items() if k not in state}))
    return state


def _buffers_in_their_dtype(model: Module, rest: dict[str, Any]) -> dict[str, Any]:
    """``rest`` with each buffer in the dtype it had before FSDP's mixed precision cast it (``buffer_dtype``), as
    torch's state dicts hold them."""
    dtypes = fsdp1_internals.buffer_dtypes(model)
    return {
        key: value.to(dtypes[key])
        if isinstance(value, torch.Tensor) and dtypes.get(key, value.dtype) != value.dtype
        else value
        for key, value in rest.items()
    }


def optimizer_state_dict(model: Module, optimizer: Optimizer) -> dict[str, Any] | None:
    """The sharded optimizer state dict, keyed by parameter name as ``FSDP.optim_state_dict`` keys it; ``None`` when
    the optimizer holds state this module cannot place (a tensor that is neither a scalar nor shaped like the
    parameter's shard): the caller then asks torch."""
    names: dict[int, list[str]] = {}  # id(parameter the optimizer sees) -> the original names it stands for
    state: dict[str, Any] = {}
    for unit in units(model):
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
            names[id(param)] = [clean_name(name)]
            if param in optimizer.state:
                state[clean_name(name)] = dict(optimizer.state[param])
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


# ------------------------------------------------------------------------------------------- full, gathered on rank 0
def supports_full(model: Module) -> bool:
    """Whether :func:`full_model_state_dict` applies: :func:`supported`, with the shards in host memory and a default
    group that carries them (:func:`~.pieces.carries_host_tensors`: not ``hccl``, with ``cpu_offload`` on Gaudi)."""
    return supported(model) and all(unit.local.device.type == "cpu" for unit in units(model)) and carries_host_tensors()


def full_model_state_dict(model: Module, rest: dict[str, Any], stream: FullStream | None = None) -> dict[str, Any]:
    """The full model state dict on rank 0 (``{}`` elsewhere): every parameter's pieces are sent straight into a
    tensor of its shape on rank 0, one message per piece, where torch all-gathers every flat parameter on every rank
    and clones each parameter out of it. ``rest``: the entries FSDP does not shard. With ``stream``, the gathered
    tensors are its placeholders, received only when the stream writes the checkpoint (see
    :mod:`..checkpoint.streaming`)."""
    import torch.distributed as dist

    pieces = [
        (param, unit.local[param.offset_in_shard : param.offset_in_shard + param.numel_in_shard])
        for unit in units(model)
        for param in unit.params
    ]
    full = gather_pieces([(param, piece, range(len(param.spans)), piece.dtype) for param, piece in pieces], stream)
    if dist.get_rank() != 0:
        return {}
    gathered = {param.fqn: tensor for (param, _), tensor in zip(pieces, full, strict=True)}
    rest = _buffers_in_their_dtype(model, {k: v for k, v in rest.items() if k not in gathered})
    return _in_module_order(model, {**gathered, **rest})


def _in_module_order(model: Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in the order ``Module.state_dict`` lists entries (a module's own parameters, then its buffers, then
    its children's), as torch's full state dict has them."""
    position: dict[str, int] = {}
    for name, _ in model.named_modules():
        position.setdefault(clean_name(name), len(position))
    buffers = {clean_name(name) for name, _ in model.named_buffers()}

    def order(key: str) -> tuple[int, bool]:
        owner = key.rpartition(".")[0]
        return position.get(owner, len(position)), key in buffers

    return {key: state[key] for key in sorted(state, key=order)}


def full_optimizer_state_dict(
    model: Module, optimizer: Optimizer, stream: FullStream | None = None
) -> dict[str, Any] | None:
    """The full optimizer state on rank 0 in torch's standard form (keyed by the index of each parameter in
    ``model.parameters()``), ``{}`` elsewhere, gathered as :func:`full_model_state_dict` gathers weights. ``None`` on
    every rank (the caller then asks torch) unless every unit keeps its original parameters and the ranks holding
    each parameter all hold its state, each tensor of it shaped like their piece."""
    import torch.distributed as dist

    every = list(units(model))
    ok = all(unit.orig_params for unit in every)
    params = {
        id(orig): (param, orig) for unit in every for param, orig in zip(unit.params, unit.orig_params, strict=False)
    }
    # What this rank holds of each parameter's state: tensors as ("piece", dtype name), anything else as its value.
    specs: dict[str, dict[str, Any]] = {}
    local: dict[tuple[str, str], torch.Tensor] = {}
    for param, orig in params.values():
        for key, value in optimizer.state.get(orig, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                ok = ok and value.dim() == 1 and value.numel() == param.numel_in_shard
                specs.setdefault(param.fqn, {})[key] = ("piece", str(value.dtype).removeprefix("torch."))
                local[(param.fqn, key)] = value.detach()
            else:
                specs.setdefault(param.fqn, {})[key] = value
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (ok, specs))
    merged: dict[str, dict[str, Any]] = {}  # fqn -> key -> spec, the first rank's that has it
    for _, rank_specs in everyone:
        for fqn, keys in rank_specs.items():
            for key, spec in keys.items():
                merged.setdefault(fqn, {}).setdefault(key, spec)
    pieces, targets = [], []
    for param, _ in params.values():
        for key, spec in merged.get(param.fqn, {}).items():
            if not (isinstance(spec, tuple) and spec[:1] == ("piece",)):
                continue
            holders = [r for r, (_, rank_specs) in enumerate(everyone) if key in rank_specs.get(param.fqn, {})]
            # every rank that holds elements of the parameter must hold this state: nothing is left unset
            ok = ok and all(r in holders for r, (lo, hi) in enumerate(param.spans) if hi > lo)
            pieces.append((param, local.get((param.fqn, key)), holders, getattr(torch, spec[1])))
            targets.append((param.fqn, key))
    if not (ok and all(rank_ok for rank_ok, _ in everyone)):
        return None
    full = gather_pieces(pieces, stream)
    if dist.get_rank() != 0:
        return {}
    ids = {id(p): i for i, p in enumerate(model.parameters())}
    index = {clean_name(name): ids[id(p)] for name, p in model.named_parameters()}
    state = {index[fqn]: dict(keys) for fqn, keys in merged.items()}
    for (fqn, key), tensor in zip(targets, full, strict=True):
        state[index[fqn]][key] = tensor
    for param in model.parameters():  # parameters FSDP does not manage keep their state as it is
        if id(param) not in params and param in optimizer.state:
            state[ids[id(param)]] = dict(optimizer.state[param])
    groups = param_groups_by_id(optimizer.param_groups, ids, sort=True)
    return {"state": dict(sorted(state.items())), "param_groups": groups}
