"""Pretrained weights into a sharded model: each rank reads only the slices it owns.

``pretrained_weights`` names a Hugging Face model directory (``model.safetensors``, or several files with
``model.safetensors.index.json``), one ``.safetensors`` file, or a checkpoint of this strategy (full, sharded or
local; its model weights only). The strategy builds the model with its parameters on the meta device
(:func:`parameters_on_meta`; buffers such as rotary ``inv_freq`` are computed as usual), matches every parameter to a
file key before wrapping (:func:`plan`, which raises :class:`PretrainedWeightsError` on any mismatch), gives the
shards uninitialised memory while wrapping (:func:`empty_init`) and then copies into them (:func:`load`):

- FSDP1: each original parameter's part of the rank's flat-parameter shard (``_shard_param_infos``);
- FSDP2: each DTensor's local shard (rows of dimension 0).

safetensors files are memory-mapped and read a slice at a time (``safe_open(...).get_slice(key)[a:b]``), so a rank
reads about its shard (:mod:`.pretrained_source`). A checkpoint is read a tensor (one local FSDP1 unit) at a time.
Parameters no file covers are PEFT adapters, initialised as PEFT initialises them (LoRA ``B`` = 0, ``A``
Kaiming-uniform; embedding adapters ``A`` = 0, ``B`` normal), the same on every rank and at every world size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn import Module, Parameter

from lightning_gaudi_fsdp.adapters import fsdp1_internals, torch_internals
from lightning_gaudi_fsdp.adapters.fsdp1_internals import clean_name, join_name
from lightning_gaudi_fsdp.checkpoint import hf_names
from lightning_gaudi_fsdp.checkpoint.pretrained_source import PretrainedWeightsError, Source, Weights, resolve

__all__ = [
    "Plan",
    "PretrainedWeightsError",
    "Source",
    "Weights",
    "empty_init",
    "load",
    "load_dtensors",
    "parameters_on_meta",
    "plan",
    "resolve",
]
_SHOWN = 3  # keys listed in a mismatch message


def _flat_range(read: Callable[[int, int], torch.Tensor], shape: tuple[int, ...], start: int, stop: int) -> Any:
    """Elements ``start:stop`` of the flattened tensor, reading only the rows that hold them."""
    if not shape:
        return read(0, 1).reshape(-1)[start:stop]
    row = math.prod(shape[1:]) or 1
    first, last = start // row, -(-stop // row)
    return read(first, last).reshape(-1)[start - first * row : stop - first * row]


# ------------------------------------------------------------------------------------------------------ matching
@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one parameter's values come from: a file ``key``, or an ``adapter`` initialisation."""

    shape: tuple[int, ...]
    key: str | None = None
    adapter: str | None = None  # "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"
    init: Any = True  # PEFT's init_lora_weights for the adapter
    seed: int = 0


@dataclasses.dataclass
class Plan:
    source: Source
    entries: dict[str, Entry]  # clean module key -> where its values come from
    seed: int = 0  # adapters' random draws (torch's seed; the strategy sets rank 0's on every rank)


def plan(model: Module, weights: Weights, *, weights_only: bool = True) -> Plan:
    """Match every parameter of the (unwrapped) ``model`` to a file key; raise :class:`PretrainedWeightsError` with
    what does not fit, before any weight is read."""
    source = Source(weights, weights_only=weights_only)
    named = [(clean_name(n), p) for n, p in model.named_parameters(remove_duplicate=False)]
    canonical: dict[int, str] = {}
    aliases: set[str] = set()
    for name, param in named:
        if id(param) in canonical:
            aliases.add(name)  # tied weights: the file may name either
        else:
            canonical[id(param)] = name
    params = {name: p for name, p in named if name not in aliases}
    init_of = _lora_inits(model)
    prefix = weights.prefix
    entries: dict[str, Entry] = {}
    used: set[str] = set()
    uncovered: list[str] = []
    for index, (name, param) in enumerate(params.items()):
        key = _file_key(name, prefix, source.meta)
        if key is not None:
            _check_fits(weights, source, key, name, param)
            entries[name] = Entry(tuple(param.shape), key=key)
            used.add(key)
        elif hf_names.is_adapter_key(name):
            entries[name] = _adapter_entry(weights, name, param, init_of, index)
        else:
            uncovered.append(name)
    used.update(k for alias in aliases if (k := _file_key(alias, prefix, source.meta)) is not None)
    unmatched = [key for key in source.meta if key not in used]
    if unmatched or uncovered:
        raise PretrainedWeightsError(_mismatch(weights, source, unmatched, uncovered, list(params)))
    return Plan(source, entries, torch.initial_seed())


def _file_key(name: str, prefix: str, keys: Mapping[str, Any]) -> str | None:
    for candidate in dict.fromkeys((name, hf_names.base_key(name))):
        if candidate.startswith(prefix) and candidate[len(prefix) :] in keys:
            return candidate[len(prefix) :]
    return None


def _check_fits(weights: Weights, source: Source, key: str, name: str, param: torch.Tensor) -> None:
    shape, dtype = source.meta[key]
    where = f"{weights.describe()}: file {source.where[key]!r} key {key!r}"
    if tuple(shape) != tuple(param.shape):
        raise PretrainedWeightsError(
            f"{where} has shape {list(shape)} but parameter {name!r} has shape {list(param.shape)}"
        )
    if not isinstance(dtype, torch.dtype):
        raise PretrainedWeightsError(f"{where} has dtype {dtype!r}, which torch cannot read")
    if dtype != param.dtype and not (dtype.is_floating_point and param.dtype.is_floating_point):
        raise PretrainedWeightsError(
            f"{where} has dtype {str(dtype).removeprefix('torch.')}, which does not convert to parameter {name!r} "
            f"of dtype {str(param.dtype).removeprefix('torch.')} (only floating-point dtypes convert to each other)"
        )


def _mismatch(weights: Weights, source: Source, unmatched: list[str], uncovered: list[str], names: list[str]) -> str:
    parts = [f"{weights.describe()} does not fit the model (pretrained_prefix={weights.prefix!r})"]
    if unmatched:
        shown = ", ".join(f"{k!r} ({source.where[k]})" for k in unmatched[:_SHOWN])
        more = f" and {len(unmatched) - _SHOWN} more" if len(unmatched) > _SHOWN else ""
        parts.append(f"{len(unmatched)} file key(s) match no parameter: {shown}{more}")
    if uncovered:
        shown = ", ".join(repr(k) for k in uncovered[:_SHOWN])
        more = f" and {len(uncovered) - _SHOWN} more" if len(uncovered) > _SHOWN else ""
        parts.append(f"{len(uncovered)} parameter(s) no file key covers: {shown}{more}")
    suggestion = suggest_prefix(names, source.meta, weights.prefix)
    if suggestion is not None:
        parts.append(f"pretrained_prefix={suggestion[0]!r} would match {suggestion[1]} of {len(source.meta)} file keys")
    return "; ".join(parts)


def suggest_prefix(names: Iterable[str], keys: Mapping[str, Any], current: str = "") -> tuple[str, int] | None:
    """The prefix (other than ``current``) under which the most file ``keys`` name a parameter, and how many."""
    bases = [hf_names.base_key(n) for n in names]
    counts: dict[str, int] = {}
    for base in bases:
        parts = base.split(".")
        for cut in range(len(parts)):
            tail = ".".join(parts[cut:])
            if tail in keys:
                head = ".".join(parts[:cut])
                prefix = f"{head}." if head else ""
                counts[prefix] = counts.get(prefix, 0) + 1
    counts.pop(current, None)
    if not counts:
        return None
    best = max(counts, key=lambda p: counts[p])
    return best, counts[best]


def _lora_inits(model: Module) -> dict[str, Any]:
    """PEFT's ``init_lora_weights`` of each adapter name, from a ``peft_config`` found in ``model``."""
    for module in model.modules():
        config = getattr(module, "peft_config", None)
        if isinstance(config, Mapping):
            return {name: getattr(cfg, "init_lora_weights", True) for name, cfg in config.items()}
    return {}


def _adapter_entry(weights: Weights, name: str, param: torch.Tensor, inits: Mapping[str, Any], index: int) -> Entry:
    parts = name.split(".")
    kind = next(p for p in parts if p in hf_names.ADAPTER_SEGMENTS)
    after = parts[parts.index(kind) + 1 :]
    adapter = after[0] if after and after[0] != "weight" else "default"
    init = inits.get(adapter, True)
    if isinstance(init, str) and init.lower() == "gaussian":
        init = "gaussian"
    if kind == "lora_magnitude_vector" or init not in (True, False, "gaussian"):
        raise PretrainedWeightsError(
            f"{weights.describe()}: parameter {name!r} is a PEFT adapter whose initialisation "
            f"({'DoRA magnitude' if kind == 'lora_magnitude_vector' else f'init_lora_weights={init!r}'}) needs the "
            "base weights; with pretrained_weights, adapters support init_lora_weights=True, False or 'gaussian'"
        )
    return Entry(tuple(param.shape), adapter=kind, init=init, seed=index)


def adapter_values(entry: Entry, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The full adapter tensor as PEFT initialises it, drawn from a generator seeded by ``seed`` and the
    parameter's position, so every rank (and every world size) draws the same values."""
    generator = torch.Generator().manual_seed(seed + entry.seed)
    out = torch.empty(entry.shape, dtype=torch.float32)
    kind, init = entry.adapter, entry.init
    if kind in ("lora_A", "lora_B"):
        if out.dim() < 2 or (kind == "lora_B" and init is not False):
            out.zero_()  # B (and any LoRA bias) starts at zero: the adapted model equals the base model
        elif kind == "lora_A" and init == "gaussian":
            out.normal_(0.0, 1.0 / entry.shape[0], generator=generator)
        else:  # nn.Linear's own initialisation, which PEFT keeps for A (and for B with init_lora_weights=False)
            torch.nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=generator)
    elif kind == "lora_embedding_A" and init is not False:
        out.zero_()
    else:  # embedding B (and A with init_lora_weights=False): standard normal, as PEFT creates them
        out.normal_(0.0, 1.0, generator=generator)
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------------- building
@contextmanager
def parameters_on_meta() -> Generator[None, None, None]:
    """Modules built inside get their parameters on the meta device (no memory, no initialisation); buffers are
    computed as usual (rotary ``inv_freq`` is not in weights files). Parameters are created empty and moved, one at
    a time, as accelerate's ``init_empty_weights(include_buffers=False)`` does."""
    original = Module.register_parameter

    def register(module: Module, name: str, param: Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = dict(vars(param))
            kwargs["requires_grad"] = param.requires_grad
            torch_internals.replace_parameter(module, name, type(param)(param.to("meta"), **kwargs))

    Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        Module.register_parameter = original  # type: ignore[method-assign]


def empty_init(device: torch.device) -> Callable[[Module], None]:
    """A ``param_init_fn``: give the module's meta parameters (and meta buffers) uninitialised memory on ``device``;
    tensors already materialised (buffers computed at construction) are kept."""

    def init(module: Module) -> None:
        torch_internals.apply_to_own_tensors(module, lambda t: torch.empty_like(t, device=device) if t.is_meta else t)

    return init


# ------------------------------------------------------------------------------------------------------ loading
def _reader(prepared: Plan, name: str, entry: Entry, dtype: torch.dtype) -> Callable[[int, int], torch.Tensor]:
    if entry.key is not None:
        key = entry.key
        return lambda start, stop: prepared.source.rows(key, start, stop)
    full = adapter_values(entry, dtype, prepared.seed)
    return lambda start, stop: full if full.dim() == 0 else full[start:stop]


def _materialize_meta(model: Module, device: torch.device | str) -> None:
    """Parameters no FSDP unit manages (``ignored_modules``/``ignored_states``) are loaded whole; FSDP1 leaves them
    on the meta device, so they get memory on ``device`` first."""
    materialize = empty_init(torch.device(device))
    for module in model.modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            materialize(module)


@torch.no_grad()
def load(model: Module, prepared: Plan, device: torch.device | str = "cpu") -> int:
    """Copy the rank's part of every planned parameter into ``model``, unsharded or sharded by FSDP1 (its flat
    parameters' slices); parameters no unit manages get memory on ``device`` first. Returns the number of elements
    written."""
    _materialize_meta(model, device)
    written = 0
    seen: set[str] = set()
    for unit in fsdp1_internals.units(model):
        local = unit.flat_param.data
        for fqn, shape, info in zip(unit.fqns, unit.shapes, unit.shard_infos, strict=True):
            name = join_name(unit.name, fqn)
            seen.add(name)
            if not info.in_shard:
                continue
            entry = prepared.entries[name]
            values = _flat_range(_reader(prepared, name, entry, local.dtype), shape, info.start, info.stop)
            local[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].copy_(values)
            written += info.stop - info.start
    written += _load_unmanaged(model, prepared, seen)
    return written


@torch.no_grad()
def load_dtensors(model: Module, prepared: Plan, device: torch.device | str = "cpu") -> int:
    """:func:`load` for a model sharded by FSDP2 (each parameter's dim-0 chunk of this rank)."""
    _materialize_meta(model, device)
    from torch.distributed.tensor import DTensor

    written = 0
    seen: set[str] = set()
    for raw, param in model.named_parameters():
        name = clean_name(raw)
        if not isinstance(param, DTensor) or name not in prepared.entries:
            continue
        seen.add(name)
        entry = prepared.entries[name]
        local = param.to_local()
        if local.numel() == 0:
            continue
        start = torch_internals.dim0_offset(param)
        read = _reader(prepared, name, entry, local.dtype)
        local.copy_(read(start, start + local.shape[0]) if local.dim() else read(0, 1))
        written += local.numel()
    written += _load_unmanaged(model, prepared, seen)
    return written


def _load_unmanaged(model: Module, prepared: Plan, seen: set[str]) -> int:
    """Parameters that no FSDP unit shards (``ignored_modules``/``ignored_states``): whole tensors."""
    from torch.distributed.tensor import DTensor

    written = 0
    for raw, param in model.named_parameters():
        name = clean_name(raw)
        if name in seen or name not in prepared.entries:
            continue
        if isinstance(param, DTensor):
            continue
        entry = prepared.entries[name]
        param.data.copy_(_reader(prepared, name, entry, param.dtype)(0, param.shape[0] if param.dim() else 1))
        written += param.numel()
    return written
