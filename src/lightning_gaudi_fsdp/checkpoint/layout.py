"""The flat-parameter layout of an FSDP model, and how to rebuild full tensors from local shards.

FSDP1 flattens the parameters of each wrapped unit into one ``_flat_param`` and gives every rank a contiguous slice.
The layout recorded here (state-dict key, original names, shapes, numels, alignment padding) is what a ``local``
checkpoint stores in its metadata so that it can be turned into full tensors offline, with no process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn import Module

from lightning_gaudi_fsdp.adapters import fsdp1_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import join_name

FLAT_PARAM = "_flat_param"


def flat_param_layout(model: Module) -> list[dict[str, Any]]:
    """One entry per FSDP unit that owns parameters, in module order."""
    return [
        {
            "key": join_name(unit.name, FLAT_PARAM),
            "prefix": unit.name,
            "fqns": list(unit.fqns),
            "shapes": [list(s) for s in unit.shapes],
            "numels": list(unit.numels),
            "numels_with_padding": list(unit.numels_with_padding),
            "is_padding_mask": list(unit.is_padding_mask),
            "dtype": str(unit.dtype).removeprefix("torch."),
        }
        for unit in fsdp1_internals.units(model)
    ]


def fsdp_units(model: Module) -> list[str]:
    """Clean names of every FSDP unit (the wrap layout); ``""`` is the root."""
    return list(fsdp1_internals.unit_sizes(model))


def join_rank_slices(slices: Iterable[torch.Tensor]) -> torch.Tensor:
    """Every rank's contiguous slice of one (flat) tensor, in rank order, as the whole flat tensor."""
    return torch.cat([piece.reshape(-1) for piece in slices])


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
        out[join_name(entry["prefix"], fqn)] = piece.reshape(shape).clone()
    return out
