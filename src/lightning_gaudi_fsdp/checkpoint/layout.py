"""The flat-parameter layout of an FSDP model, and how to rebuild full tensors from local shards.

FSDP1 flattens the parameters of each wrapped unit into one ``_flat_param`` and gives every rank a contiguous slice.
The layout recorded here (state-dict key, original names, shapes, numels, alignment padding) is what a ``local``
checkpoint stores in its metadata so that it can be turned into full tensors offline, with no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn import Module

FLAT_PARAM = "_flat_param"


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def flat_param_layout(model: Module) -> list[dict[str, Any]]:
    """One entry per FSDP unit that owns parameters, in module order."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    layout: list[dict[str, Any]] = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        flat = module._handle.flat_param
        prefix = _clean(name)
        numels_with_padding = list(getattr(flat, "_numels_with_padding", None) or flat._numels)
        padding_mask = list(getattr(flat, "_is_padding_mask", None) or [False] * len(numels_with_padding))
        layout.append(
            {
                "key": _join(prefix, FLAT_PARAM),
                "prefix": prefix,
                "fqns": list(flat._fqns),
                "shapes": [list(s) for s in flat._shapes],
                "numels": [int(n) for n in flat._numels],
                "numels_with_padding": [int(n) for n in numels_with_padding],
                "is_padding_mask": [bool(p) for p in padding_mask],
                "dtype": str(flat.dtype).removeprefix("torch."),
            }
        )
    return layout


def fsdp_units(model: Module) -> list[str]:
    """Clean names of every FSDP unit (the wrap layout); ``""`` is the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [_clean(name) for name, module in model.named_modules() if isinstance(module, FSDP)]


def unflatten(flat: torch.Tensor, entry: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Split an unsharded, unpadded flat parameter into its original tensors, keyed by full name."""
    expected = sum(entry["numels_with_padding"])
    if flat.numel() < expected:
        raise ValueError(f"{entry['key']}: flat parameter has {flat.numel()} elements, layout needs {expected}")
    out: dict[str, torch.Tensor] = {}
    pieces = torch.split(flat[:expected], entry["numels_with_padding"])
    originals = iter(zip(entry["fqns"], entry["shapes"], strict=True))
    for piece, is_padding in zip(pieces, entry["is_padding_mask"], strict=True):
        if is_padding:
            continue
        fqn, shape = next(originals)
        out[_join(entry["prefix"], fqn)] = piece.reshape(shape).clone()
    return out
