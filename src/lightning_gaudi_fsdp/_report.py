"""What the strategy tells the user: the effective configuration table and the versions in use."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from typing import TYPE_CHECKING

from torch.nn import Module

if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("lightning_gaudi_fsdp")


@functools.cache
def _dist_version(name: str) -> str | None:
    # Cached: reading a distribution's metadata took about 6 ms, and every local save records the versions.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    import torch

    found = {
        "torch": torch.__version__,
        "lightning": _dist_version("lightning") or _dist_version("pytorch-lightning") or "unknown",
        "lightning-gaudi-fsdp": _dist_version("lightning-gaudi-fsdp") or "unknown",
    }
    from lightning_gaudi_fsdp import gaudi

    bridge = gaudi.bridge_version()
    if bridge is not None:
        found["habana-torch-plugin"] = bridge
    return found


def fsdp_unit_count(model: Module) -> int:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_gaudi_fsdp.engine import fsdp2

    if fsdp2.is_fsdp2(model):
        return len(fsdp2.unit_names(model))
    return sum(isinstance(m, FSDP) for m in model.modules())


def held_elements(model: Module) -> int:
    """Elements of the flat parameters (FSDP1) or parameter shards (FSDP2) this rank holds (its shards, or whole
    parameters where unsharded)."""
    from lightning_gaudi_fsdp.engine import fsdp1_state, fsdp2

    if fsdp2.is_fsdp2(model):
        return fsdp2.held_elements(model)
    return sum(p.numel() for p in fsdp1_state.flat_params(model))


def _held_row(held_per_rank: list[int]) -> str:
    low, high = min(held_per_rank), max(held_per_rank)
    if low == high:
        return f"{low:,} elements on each of {len(held_per_rank)} rank(s)"
    return f"{low:,} to {high:,} elements (rank {held_per_rank.index(high)} holds the most)"


def configuration_table(strategy: Any, model: Module, held_per_rank: list[int], precision: tuple[str, str]) -> str:
    """The table rank 0 prints when a door sets the model up (the Trainer at fit start, Fabric in ``setup_module``).
    ``strategy``: either door; ``precision``: the row naming the door's precision setting."""
    fsdp2 = strategy._fsdp_version == 2
    mp = strategy._mp_policy if fsdp2 else strategy.mixed_precision_config
    if mp is None:
        dtypes = "fp32 (no FSDP mixed precision)"
    elif fsdp2:
        dtypes = f"param={mp.param_dtype}, reduce={mp.reduce_dtype}, output={mp.output_dtype}"
    else:
        dtypes = f"param={mp.param_dtype}, reduce={mp.reduce_dtype}, buffer={mp.buffer_dtype}"
    rows = [
        ("engine", "FSDP2 (fully_shard)" if fsdp2 else "FSDP1 (FullyShardedDataParallel)"),
        ("sharding", strategy.sharding_strategy.name),
        ("FSDP units", str(fsdp_unit_count(model))),
        ("parameter shards per rank" if fsdp2 else "flat parameters per rank", _held_row(held_per_rank)),
        ("mixed precision", dtypes),
        precision,
        ("state_dict_type", strategy._state_dict_type + (", saved in the background" if strategy._background else "")),
        ("backend", str(strategy.process_group_backend)),
        ("device", str(strategy.root_device)),
        ("world size", str(strategy.world_size)),
    ]
    if strategy._cache_off_in_training:
        names = ", ".join(n or "<root>" for n in strategy._cache_off_in_training)
        rows.append(("KV cache in training", f"off in {names} (activation checkpointing); evaluation keeps use_cache"))
    width = max(len(k) for k, _ in rows)
    lines = ["GaudiFSDPStrategy configuration:"] + [f"  {k.ljust(width)} : {v}" for k, v in rows]
    return "\n".join(lines)


def compiled_units(names: list[str]) -> None:
    log.info("torch.compile applied to %d module(s): %s", len(names), ", ".join(n or "<root>" for n in names))


def fingerprint(model: Module, sharding: str) -> dict[str, object]:
    """What every rank must agree on: sharding, the FSDP units and the unsharded size of each unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_gaudi_fsdp.checkpoint.layout import _clean
    from lightning_gaudi_fsdp.engine import fsdp2

    if fsdp2.is_fsdp2(model):
        return {"sharding_strategy": sharding, "units": fsdp2.unit_names(model)}
    units = {
        _clean(name): (m._handle.flat_param._unpadded_unsharded_size.numel() if m._handle is not None else 0)
        for name, m in model.named_modules()
        if isinstance(m, FSDP)
    }
    return {"sharding_strategy": sharding, "units": units}


def disagreement(fingerprints: list[dict[str, object]]) -> str | None:
    """The error every rank raises when the gathered ``fingerprints`` (one per rank, in rank order) differ, or None.
    Each rank is compared with rank 0, so every rank builds the same message naming rank 0, the first rank that
    differs from it and their first difference."""
    first = fingerprints[0]
    rank = next((r for r, other in enumerate(fingerprints) if other != first), None)
    if rank is None:
        return None
    return (
        f"ranks disagree on the FSDP configuration (rank 0 vs rank {rank}: "
        f"{describe_difference(first, fingerprints[rank])}); every rank must build the same model with the same "
        "strategy arguments"
    )


def describe_difference(a: dict[str, object], b: dict[str, object]) -> str:
    if a["sharding_strategy"] != b["sharding_strategy"]:
        return f"sharding_strategy {a['sharding_strategy']} vs {b['sharding_strategy']}"
    units_a, units_b = dict(a["units"]), dict(b["units"])  # type: ignore[call-overload]
    if set(units_a) != set(units_b):
        return f"{len(units_a)} FSDP units {sorted(units_a)[:4]} vs {len(units_b)} units {sorted(units_b)[:4]}"
    unit = next(k for k in units_a if units_a[k] != units_b[k])
    return f"unit {unit or '<root>'!r} holds {units_a[unit]} vs {units_b[unit]} parameters"
