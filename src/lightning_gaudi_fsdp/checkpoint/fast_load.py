"""Sharded (DCP) resumes that read each rank's bytes in one pass and put them straight into its shards.

torch's way to resume a sharded checkpoint costs far more than reading it (issue 31, 2 CPU ranks, a Llama of 80
layers: 27x ``torch.load`` of the rank's share with FSDP1): every ``dcp.load`` plans with two collectives, the model
and each optimizer are read in separate passes, FSDP1's ``load_state_dict`` all-gathers each parameter again and its
``optim_state_dict_to_load`` moves and gathers optimizer state parameter by parameter (pytorch#120016, #111096,
#110479), FSDP2's ``get_optimizer_state_dict`` first runs a step on zero gradients to create state to load into, and
DCP's default planner touches every ``ShardedTensor`` through its ``__torch_function__`` (a few ms each).

Here every rank lists the pieces it holds itself, each a box of a saved tensor (offsets and sizes) and the tensor it
goes into: for the model, views of its live shards (FSDP1: its slices of each flat parameter, as
:func:`.fsdp1_state.model_state_dict` saves them; FSDP2: each parameter's local shard); for each optimizer, state
tensors allocated in the shape they have on this rank, with the keys and dtypes the checkpoint's metadata lists. One
read in this process alone (no collectives: each rank knows what it needs), planned by :class:`_PiecePlanner` and
done by the same safe reader as every other read (:mod:`.trust`), fills all of it; the ranks then tell each other
whether their read failed (damage inside one rank's entry), so that every rank raises the same error naming the file,
as torch's ``dcp.load`` does (:func:`.loading.load_sharded_fast`); each optimizer then gets its
state with ``optimizer.load_state_dict`` and the hyper-parameters kept beside the tensors in ``meta.pt``. The engine
says what it holds: its ``fast_load_params`` hands :func:`plan` a :class:`StateSource` per parameter the optimizers see,
which builds that parameter's state as it is on this rank and lists its pieces.

:func:`plan` says whether this applies (``None``: the caller takes torch's path): FSDP1 where the package saves
sharded state itself (:func:`.fsdp1_state.supported`) and with NO_SHARD units (:func:`.fsdp1_state.loadable`: at world
size 1 FSDP1 runs every sharding strategy so), FSDP2 with every parameter a DTensor; every optimizer parameter
under FSDP; only tensors in the optimizer's per-parameter state; the hyper-parameters recorded by this package for
exactly these parameters, group by group.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.checkpoint import files
from lightning_gaudi_fsdp.checkpoint.files import Where
from lightning_gaudi_fsdp.checkpoint.formats import CheckpointError, merge_groups
from lightning_gaudi_fsdp.checkpoint.storage import first_line

# A DCP key -> the pieces this rank reads of it: (offsets of the box in the saved tensor, the tensor it goes into,
# shaped like the box).
Pieces = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]


@dataclass
class _Optimizer:
    """One optimizer's part of the read: per parameter index, the state tensors the read fills."""

    state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class Plan:
    """What one rank reads, and how the optimizer entries become each optimizer's state afterwards."""

    pieces: Pieces
    optimizers: list[tuple[Optimizer, _Optimizer, list[dict[str, Any]]]]
    live: list[tuple[torch.Tensor, torch.Tensor]]  # (read into, live tensor) where the two are not the same memory


def _saved_entries(metadata: Any) -> dict[str, dict[str, Any]]:
    """The checkpoint's entries grouped by owner: ``"optimizer_0.state.<fqn>"`` -> {``"exp_avg"``: its metadata}."""
    grouped: dict[str, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        owner, _, leaf = key.rpartition(".")
        grouped.setdefault(owner, {})[leaf] = md
    return grouped


def plan(
    model: Module,
    model_state: Mapping[str, Any],
    optimizers: Sequence[Optimizer],
    metadata: Any,
    groups: Sequence[Any],
    *,
    strict: bool,
    load_optimizers: bool,
    params_of: Callable[[Module], Params | None],
    model_key: str = "model",
    optimizer_keys: Sequence[str | None] = (),
) -> Plan | None:
    """The read that fills ``model`` (from ``model_state``, the sharded template :func:`.loading.check_load` built)
    and ``optimizers``; ``None`` where torch's path must do it (see the module's docstring). ``model_key``,
    ``optimizer_keys``: the DCP keys of the model and of each optimizer (the Trainer's: ``model``,
    ``optimizer_<i>``; a Fabric checkpoint's: the keys of the user's state, see :mod:`.views`). ``params_of``: the
    engine's list of the parameters its optimizers see (:data:`Params`), ``None`` where this engine's model is not
    one this read can fill."""
    params = params_of(model)
    if params is None:
        return None
    keys = set(metadata.state_dict_metadata)
    model_template = {k: v for k, v in model_state.items() if strict or f"{model_key}.{k}" in keys}
    live = _live_copies(model, model_template)
    if live is None:
        return None
    pieces: Pieces = {f"{model_key}.{k}": pieces_of(v) for k, v in model_template.items()}
    planned: list[tuple[Optimizer, _Optimizer, list[dict[str, Any]]]] = []
    if load_optimizers and not all(k.startswith(f"{model_key}.") for k in keys):
        saved = _saved_entries(metadata)
        for idx, optimizer in enumerate(optimizers):
            key = optimizer_keys[idx] if idx < len(optimizer_keys) else f"optimizer_{idx}"
            saved_groups = groups[idx].get("param_groups") if idx < len(groups) else None
            if key is None or not any(k.startswith(f"{key}.") for k in keys):
                return None  # torch's path raises its error
            names = [[n for p in g["params"] for n in params.get(id(p), ((), None))[0]] for g in optimizer.param_groups]
            if saved_groups is None or [g.get("params") for g in saved_groups] != names:
                return None
            one = _optimizer_pieces(optimizer, params, saved, key, pieces)
            if one is None:
                return None
            planned.append((optimizer, one, saved_groups))
    return Plan(pieces, planned, live)


def pieces_of(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """This rank's pieces of a template entry: a ``ShardedTensor``'s local shards, a DTensor's local chunk, or a
    plain tensor whole."""
    from torch.distributed.tensor import DTensor

    if hasattr(value, "local_shards"):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = torch_internals.dtensor_local(value)  # to_local would run an autograd function per tensor
        return [(offsets, local) for offsets in _chunk_offsets(value) if local.numel() > 0]
    return [((0,) * value.dim(), value)]


_OFFSETS: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}


def _chunk_offsets(value: Any) -> list[tuple[int, ...]]:
    """Where this rank's chunk of a DTensor starts (DCP's own computation, a millisecond each): computed once per
    global shape, layout, mesh and place of this rank in it (an 80-layer model has a handful)."""
    mesh = value.device_mesh
    coordinate = tuple(mesh.get_coordinate() or ())  # a list on torch 2.9, a tuple on newer torch
    key = (tuple(value.shape), tuple(value.stride()), tuple(value.placements), repr(mesh), coordinate)
    if key not in _OFFSETS:
        _OFFSETS[key] = [tuple(c.offsets) for c in value.__create_chunk_list__()]
    return _OFFSETS[key]


def _live_copies(model: Module, template: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The entries of the template that are not the model's own memory (FSDP1: buffers and parameters FSDP does not
    shard, copied off an accelerator; its sharded entries are views by construction), paired with the local tensor
    they are copied into after the read; ``None`` for an entry that is not one of the model's tensors."""
    from torch.distributed.tensor import DTensor

    from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name as _clean

    own = {_clean(n): t for n, t in (*model.named_parameters(), *model.named_buffers())}
    pairs = []
    for key, value in template.items():
        if hasattr(value, "local_shards"):
            continue
        target = own.get(key)
        if not isinstance(value, torch.Tensor) or target is None:
            return None
        if isinstance(value, DTensor) != isinstance(target, DTensor):
            return None
        if isinstance(value, DTensor):
            value, target = value.to_local(), target.to_local()
        if value.data_ptr() != target.data_ptr() or value.dtype != target.dtype or value.shape != target.shape:
            pairs.append((value, target.detach()))
    return pairs


# ----------------------------------------------------------------------------------------------- optimizer state
class StateSource(Protocol):
    """What an engine hands :func:`plan` for one parameter its optimizers see (``fsdp1_io.fast_load_params``,
    ``fsdp2_io.fast_load_params``): it builds that parameter's optimizer state as it is on this rank."""

    def read_state(
        self, prefixes: list[str], entries: list[Mapping[str, Any]], pieces: Pieces
    ) -> dict[str, torch.Tensor] | None:
        """The state tensors, allocated as on this rank, with the pieces the read fills added to ``pieces`` (under
        ``prefixes``: one per name the parameter stands for; ``entries``: the saved metadata of each, leaf by leaf);
        ``{}``: no state on this rank; ``None``: torch's path must load it."""


# For each parameter the optimizer sees (by id): the names it stands for, and what builds its state.
Params = dict[int, tuple[list[str], StateSource]]


def _optimizer_pieces(
    optimizer: Optimizer, params: Params, saved: Mapping[str, Any], key: str, pieces: Pieces
) -> _Optimizer | None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    one = _Optimizer()
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in params:
                return None  # a parameter FSDP does not manage: torch's path
            names, source = params[id(p)]
            prefixes = [f"{key}.state.{name}" for name in names]
            entries = [saved.get(prefix, {}) for prefix in prefixes]
            if any(not isinstance(md, TensorStorageMetadata) for e in entries for md in e.values()):
                return None  # non-tensor state (a Python number): torch's path unpickles it
            state = source.read_state(prefixes, entries, pieces)
            if state is None:
                return None
            if state:
                one.state[index] = state
            index += 1
    return one


def scalar_state(where: str, md: Any, pieces: Pieces) -> torch.Tensor:
    """A 0-dim state tensor (``step``), read whole from entry ``where`` (``md``: its saved metadata)."""
    tensor = torch.empty((), dtype=md.properties.dtype)
    pieces[where] = [((), tensor)]
    return tensor


def param_state(
    prefix: str,
    entries: Mapping[str, Any],
    shape: tuple[int, ...],
    pieces: Pieces,
    allocate: Callable[[torch.dtype], tuple[torch.Tensor, list[tuple[tuple[int, ...], torch.Tensor]]]],
) -> dict[str, torch.Tensor] | None:
    """The state of one original parameter of ``shape`` (FSDP1 with ``use_orig_params``, FSDP2), its pieces added to
    ``pieces``: a tensor of the parameter's full shape is this rank's piece of it (``allocate(dtype)``: the state
    tensor as on this rank and its pieces), a 0-dim tensor (``step``) is read whole; ``None`` for any other shape."""
    state: dict[str, torch.Tensor] = {}
    for leaf, md in entries.items():
        where = f"{prefix}.{leaf}"
        if tuple(md.size) == ():
            state[leaf] = scalar_state(where, md, pieces)
        elif tuple(md.size) != tuple(shape):
            return None
        else:
            state[leaf], pieces[where] = allocate(md.properties.dtype)
    return state


# ----------------------------------------------------------------------------------------------------- reading
class _PiecePlanner:
    """A DCP load planner over :data:`Pieces`: it reads exactly the listed boxes into their tensors, with no state
    dict to walk (DCP's default planner visits every ``ShardedTensor`` through its ``__torch_function__``). Built
    on :func:`torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list`, as torch's own planner
    is."""

    def __new__(cls, pieces: Pieces) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        class PiecePlanner(LoadPlanner):
            def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
                self.metadata = metadata

            def create_local_plan(self) -> Any:
                items = []
                for key, wanted in pieces.items():
                    md = self.metadata.state_dict_metadata.get(key)
                    if md is None:
                        raise RuntimeError(f"Missing key in checkpoint state_dict: {key}.")
                    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(t.shape)) for o, t in wanted]
                    items += create_read_items_for_chunk_list(key, md, chunks)
                return LoadPlan(items)

            def create_global_plan(self, global_plan: list[Any]) -> list[Any]:
                return global_plan

            def finish_plan(self, central_plan: Any) -> Any:
                return central_plan

            def load_bytes(self, read_item: Any, value: Any) -> None:
                raise RuntimeError(f"unexpected non-tensor entry {read_item.dest_index.fqn!r}")

            def resolve_tensor(self, read_item: Any) -> torch.Tensor:
                target = pieces[read_item.dest_index.fqn][read_item.dest_index.index][1]
                for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
                    if start != 0 or length != target.shape[dim]:
                        target = target.narrow(dim, start, length)
                return target

            def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
                pass

        return PiecePlanner()


def read_pieces(path: Where, metadata: Any, pieces: Pieces) -> bool:
    """Read ``pieces`` from the checkpoint at ``path``: each file opened once, its entries read in file order, each
    saved tensor decoded by :func:`.trust.tensor_from_archive` (``torch.load(..., weights_only=True)``, as DCP's own
    reader, for any it does not decode). ``False`` (nothing read) for a checkpoint whose entries are transformed
    (compressed, ...): DCP's reader must undo that."""
    from lightning_gaudi_fsdp.checkpoint.trust import tensor_from_archive

    planner = _PiecePlanner(pieces)
    planner.set_up_planner({}, metadata)
    items = planner.create_local_plan().items
    infos = [metadata.storage_data[item.storage_index] for item in items]
    if any(getattr(info, "transform_descriptors", None) for info in infos):
        return False
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for item, info in zip(items, infos, strict=True):
        by_file.setdefault(info.relative_path, []).append((info, item))
    for relative, entries in by_file.items():
        entries.sort(key=lambda entry: entry[0].offset)
        with files.open_read(path / relative, buffering=0) as handle:
            last: tuple[Any, torch.Tensor] | None = None
            for info, item in entries:
                if last is None or last[0] != (info.offset, info.length):
                    data = bytearray(info.length)
                    handle.seek(info.offset)
                    if handle.readinto(data) != info.length:
                        raise EOFError(f"{relative} ends before the entry at {info.offset} (+{info.length} bytes)")
                    try:
                        saved = tensor_from_archive(data)
                        if saved is None:
                            saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    except Exception as err:  # the bytes are there (checked) but are no tensor: damage
                        raise CheckpointError(
                            path,
                            f"shard file {relative!r} is damaged: its entry of {item.storage_index.fqn!r} at byte "
                            f"{info.offset} ({info.length} bytes) could not be read ({first_line(err)})",
                        ) from err
                    last = ((info.offset, info.length), saved)
                source = last[1]
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    source = source.narrow(dim, start, length)
                target = planner.resolve_tensor(item)
                if target.shape != source.shape:
                    raise ValueError(
                        f"{item.dest_index.fqn}: read {tuple(source.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(source)
    return True


def apply(planned: Plan, read: Any) -> None:
    """Read everything ``planned`` lists with ``read(pieces, planner)`` (one pass over the files), then put the
    optimizer state and hyper-parameters in place."""
    read(planned.pieces, _PiecePlanner(planned.pieces))
    with torch.no_grad():
        for value, target in planned.live:
            target.copy_(value)
    for optimizer, one, groups in planned.optimizers:
        groups = merge_groups(optimizer, {"param_groups": groups})
        optimizer.load_state_dict({"state": one.state, "param_groups": groups})
