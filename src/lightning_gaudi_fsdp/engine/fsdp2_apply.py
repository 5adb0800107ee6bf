"""The FSDP2 ``apply_*`` steps (torchtitan's ``apply_fsdp`` style): functions over resolved values (a mesh, a
``MixedPrecisionPolicy``, the units to shard) that change a module in place. :func:`.fsdp2.shard` decides the values
from the door's resolved options and calls them in order."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn import Module, Parameter

from lightning_gaudi_fsdp.adapters import fsdp1_internals

log = logging.getLogger("lightning_gaudi_fsdp")


def select_units(root: Module, policy: Any, ignored: Iterable[Module] = ()) -> list[Module]:
    """The modules below ``root`` that ``policy`` (an FSDP1 auto-wrap policy: module classes, size-based, callable)
    makes their own unit, bottom-up. Like FSDP1, a unit owns the parameters of its subtree not owned by a unit
    below it, which is what a size-based policy counts."""
    if policy is None:
        return []
    skip = set(ignored)
    if fsdp1_internals.is_policy(policy) and not callable(policy):
        targets = fsdp1_internals.policy_targets(policy, root, skip)
        return [m for m in post_order(root) if m in targets and m is not root]
    chosen: list[Module] = []
    owned: set[int] = set()
    for module in post_order(root):
        if module is root or module in skip:
            continue
        free = [p for p in module.parameters() if id(p) not in owned]
        if policy(module=module, recurse=False, nonwrapped_numel=sum(p.numel() for p in free)):
            chosen.append(module)
            owned.update(id(p) for p in free)
    return chosen


def post_order(root: Module) -> list[Module]:
    order: list[Module] = []

    def visit(module: Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)

    visit(root)
    return order


def apply_fsdp2(
    root: Module,
    units: Sequence[Module],
    *,
    mesh: Any,
    reshard_after_forward: bool,
    mp_policy: Any,
    offload_policy: Any,
    ignored_params: set[Parameter] | None,
    root_casts_inputs: bool,
) -> None:
    """``fully_shard`` each unit bottom-up, then the root. ``root_casts_inputs=False`` keeps the root from casting
    the batch (the units below still cast their own inputs)."""
    import dataclasses

    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    if ignored_params:
        kwargs["ignored_params"] = ignored_params  # torch >= 2.7, checked before launch
    for unit in units:
        fully_shard(unit, **kwargs)
    root_kwargs = dict(kwargs)
    if not root_casts_inputs:
        root_kwargs["mp_policy"] = dataclasses.replace(kwargs["mp_policy"], cast_forward_inputs=False)
    fully_shard(root, **root_kwargs)
    log.info("FSDP2: fully_shard applied to %d unit(s) and the root", len(units))


def set_forward_prefetch(units: Sequence[Module]) -> None:
    """Each unit starts the next unit's all-gather before its own forward (FSDP1's ``forward_prefetch``)."""
    for unit, following in zip(units, units[1:], strict=False):
        unit.set_modules_to_forward_prefetch([following])  # type: ignore[operator]


def force_sum_reductions(model: Module) -> None:
    """HCCL documents SUM, MIN and MAX only: reduce-scatter with SUM and divide, never AVG or PREMUL_SUM."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def materialize_meta(root: Module, device: torch.device, param_init_fn: Callable[[Module], None] | None) -> int:
    """Allocate the shards of parameters and buffers still on the meta device on ``device`` and initialise them,
    module by module: ``param_init_fn(module)`` when given (as FSDP1 calls it), else ``reset_parameters()``.
    Returns how many modules were initialised."""
    count = 0
    for module in root.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not any(t.is_meta for t in tensors):
            continue
        if param_init_fn is not None:
            param_init_fn(module)  # materialises the module, as FSDP1 expects of it
        else:
            module.to_empty(device=device, recurse=False)
            if callable(getattr(module, "reset_parameters", None)):
                with torch.no_grad():
                    module.reset_parameters()  # type: ignore[operator]
        count += 1
    return count
