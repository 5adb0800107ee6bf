"""FSDP1 (``FullyShardedDataParallel``) internals, read in one place.

FSDP1 flattens each wrapped unit's parameters into one ``FlatParameter`` and gives every rank a contiguous slice of it.
The layout (original names, shapes, numels, alignment padding) and where this rank's slice of each original parameter
lies are private attributes of the flat parameter and its handle; :func:`units` returns them as :class:`UnitView`
objects, and nothing outside this module reads ``_handle``, ``_fqns``, ``_shapes``, ``_numels``,
``_numels_with_padding``, ``_is_padding_mask``, ``_shard_param_infos`` or ``_unpadded_unsharded_size``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module

# The private names this module relies on (tests/test_adapters.py checks that torch still has them).
FLAT_PARAMETER_ATTRIBUTES = ("_fqns", "_shapes", "_numels", "_shard_param_infos", "_unpadded_unsharded_size")
FLAT_PARAMETER_OPTIONAL = ("_numels_with_padding", "_is_padding_mask", "_local_shard", "_params")
STATE_DICT_HOOK_MODULE = "torch.distributed.fsdp._state_dict_utils"  # where FSDP1's own state-dict hooks live
SHARD_INFO_FIELDS = ("in_shard", "offset_in_shard", "numel_in_shard", "intra_param_start_idx", "intra_param_end_idx")


def fsdp_class() -> type:
    """``FullyShardedDataParallel`` from its own module: a subclass put in place of the package's name (as tests of
    Lightning's stock strategy do) does not hide the units that FSDP's auto-wrapping builds from the original class."""
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    return FullyShardedDataParallel


def clean_name(name: str) -> str:
    """A module or parameter name as state dicts spell it: without FSDP's and the activation-checkpointing
    wrapper's prefixes."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    # torch strips each wrapper's prefix with its dot: a module name ending in one (the root unit's own module,
    # "_fsdp_wrapped_module") keeps it unless a dot follows
    return clean_tensor_name(name + ".").removesuffix(".") if name else name


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class ShardInfo:
    """This rank's part of one original parameter: elements ``[start, stop)`` of the flattened parameter, at
    ``offset_in_shard`` of the rank's flat shard (``numel_in_shard`` of them; none when not ``in_shard``)."""

    in_shard: bool
    offset_in_shard: int
    numel_in_shard: int
    start: int
    stop: int


@dataclass(frozen=True)
class UnitView:
    """One FSDP1 unit that owns a flat parameter: its layout and this rank's slice."""

    name: str  # the unit's clean module name ("" for the root)
    module: Module
    flat_param: Any
    local_shard: torch.Tensor  # this rank's shard of the flat parameter, with FSDP's padding
    fqns: tuple[str, ...]  # the original parameters' names within the unit, in flat order
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    numels_with_padding: tuple[int, ...]  # the flat parameter's segments, alignment padding included
    is_padding_mask: tuple[bool, ...]  # per segment of numels_with_padding
    shard_infos: tuple[ShardInfo, ...]  # per original parameter
    unpadded_numel: int  # elements of the unsharded flat parameter without the shard padding
    shard_padding: int  # padding at the end of this rank's shard
    world_size: int
    rank: int
    orig_params: tuple[Any, ...]  # with use_orig_params: the original parameters, as an optimizer sees them
    uses_sharded_strategy: bool
    device_mesh: Any

    @property
    def dtype(self) -> torch.dtype:
        return self.flat_param.dtype


def view(module: Module, name: str = "") -> UnitView | None:
    """The :class:`UnitView` of ``module`` if it is an FSDP1 unit that owns a flat parameter, else ``None``."""
    handle = getattr(module, "_handle", None) if isinstance(module, fsdp_class()) else None
    if handle is None:
        return None
    flat = handle.flat_param
    numels = tuple(int(n) for n in flat._numels)
    with_padding = tuple(int(n) for n in (getattr(flat, "_numels_with_padding", None) or numels))
    padding = tuple(bool(p) for p in (getattr(flat, "_is_padding_mask", None) or [False] * len(with_padding)))
    infos = tuple(
        ShardInfo(
            bool(info.in_shard),
            int(info.offset_in_shard or 0),
            int(info.numel_in_shard or 0),
            int(info.intra_param_start_idx or 0),
            int(info.intra_param_end_idx or 0) + 1 if info.in_shard else 0,
        )
        for info in flat._shard_param_infos
    )
    local = flat._local_shard if hasattr(flat, "_local_shard") else flat.data
    return UnitView(
        name=clean_name(name),
        module=module,
        flat_param=flat,
        local_shard=local,
        fqns=tuple(flat._fqns),
        shapes=tuple(tuple(int(d) for d in s) for s in flat._shapes),
        numels=numels,
        numels_with_padding=with_padding,
        is_padding_mask=padding,
        shard_infos=infos,
        unpadded_numel=int(flat._unpadded_unsharded_size.numel()),
        shard_padding=int(getattr(flat, "_shard_numel_padded", 0)),
        world_size=module.world_size,
        rank=module.rank,
        orig_params=tuple(getattr(flat, "_params", None) or ()),
        uses_sharded_strategy=bool(handle.uses_sharded_strategy),
        device_mesh=getattr(module, "_device_mesh", None),
    )


def units(model: Module) -> list[UnitView]:
    """Every FSDP1 unit of ``model`` that owns a flat parameter, in module order."""
    found = (view(module, name) for name, module in model.named_modules())
    return [unit for unit in found if unit is not None]


def flat_params(model: Module) -> list[torch.Tensor]:
    """Each FSDP1 unit's flat parameter in ``model``, once each, in module order (none for an FSDP2 model or one
    without FSDP1 units): the memory FSDP1 keeps a rank's shards in, which ``model.parameters()`` does not list with
    ``use_orig_params=True``."""
    found = {id(unit.flat_param): unit.flat_param for unit in units(model)}
    return list(found.values())


def unit_sizes(model: Module) -> dict[str, int]:
    """Each FSDP1 unit's clean name and the elements of its unsharded flat parameter (0 for a unit without one)."""
    sizes = {}
    for name, module in model.named_modules():
        if isinstance(module, fsdp_class()):
            unit = view(module, name)
            sizes[clean_name(name)] = unit.unpadded_numel if unit is not None else 0
    return sizes


def is_flat_parameter(param: Any) -> bool:
    from torch.distributed.fsdp._flat_param import FlatParameter

    return isinstance(param, FlatParameter)


def ignored_parameters(model: Module) -> Iterable[Any]:
    """The parameters the root FSDP1 unit leaves unsharded (``ignored_modules``/``ignored_states``)."""
    return getattr(model, "_ignored_params", ())


def buffer_dtypes(model: Module) -> dict[str, torch.dtype]:
    """Each buffer's dtype before FSDP1's mixed precision cast it (``buffer_dtype``), by name."""
    return getattr(model, "_buffer_name_to_orig_dtype", None) or {}


def device_mesh(module: Module) -> Any:
    """The device mesh an FSDP1 unit was built with (None without one)."""
    return getattr(module, "_device_mesh", None)


def uses_orig_params(model: Module) -> bool:
    return bool(getattr(model, "_use_orig_params", False))


def is_policy(value: Any) -> bool:
    """Whether ``value`` is one of torch's wrap-policy objects (``ModuleWrapPolicy``, ``CustomPolicy``...)."""
    from torch.distributed.fsdp.wrap import _Policy

    return isinstance(value, _Policy)


def policy_targets(policy: Any, root: Module, ignored: set[Module]) -> set[Module]:
    """The modules a wrap-policy object makes their own unit below ``root``."""
    return set(policy._run_policy(root, ignored, {}))


def mixed_requires_grad_unit(err: ValueError) -> str | None:
    """The unit named by FSDP1's refusal to flatten frozen and trainable parameters together
    (``use_orig_params=False``), read from torch's message; None for any other error."""
    text = str(err)
    return text.split(" has both", 1)[0] if "requires_grad=True and False" in text else None


def hybrid_zero2() -> Any:
    """``ShardingStrategy._HYBRID_SHARD_ZERO2`` (torch spells it private)."""
    from torch.distributed.fsdp import ShardingStrategy

    return ShardingStrategy._HYBRID_SHARD_ZERO2
