"""What the strategy tells the user: the effective configuration table and the versions in use."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from typing import TYPE_CHECKING

from torch.nn import Module

from lightning_gaudi_fsdp.engine.pieces import gather_objects

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


def _held_row(held_per_rank: list[int]) -> str:
    low, high = min(held_per_rank), max(held_per_rank)
    if low == high:
        return f"{low:,} elements on each of {len(held_per_rank)} rank(s)"
    return f"{low:,} to {high:,} elements (rank {held_per_rank.index(high)} holds the most)"


def configuration_table(strategy: Any, model: Module, held_per_rank: list[int], precision: tuple[str, str]) -> str:
    """The table rank 0 prints when a door sets the model up (the Trainer at fit start, Fabric in ``setup_module``).
    ``strategy``: either door; ``precision``: the row naming the door's precision setting."""
    engine = strategy._engine
    rows = [
        ("engine", engine.label),
        ("sharding", strategy._config.sharding_strategy.name),
        ("FSDP units", str(engine.unit_count(model))),
        (engine.held_label, _held_row(held_per_rank)),
        ("mixed precision", engine.mixed_precision_row(strategy)),
        precision,
        (
            "state_dict_type",
            strategy._config.state_dict_type + (", saved in the background" if strategy._background else ""),
        ),
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


def fingerprint(engine: Any, model: Module, sharding: str) -> dict[str, object]:
    """What every rank must agree on: sharding, the FSDP units and the unsharded size of each unit."""
    return {"sharding_strategy": sharding, "units": engine.fingerprint(model)}


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


def check_ranks_agree(door: Any, model: Module) -> list[int]:
    """Ranks that wrapped the model differently would deadlock or corrupt in the first collective: compare a
    fingerprint of the wrapping on every rank first and fail on all of them with the difference. Returns the
    flat-parameter elements (FSDP1) or parameter-shard elements (FSDP2) each rank holds."""
    own = fingerprint(door._engine, model, door._config.sharding_strategy.name)
    gathered_pairs = gather_objects((own, door._engine.held_elements(model)), door.world_size)
    message = disagreement([pair[0] for pair in gathered_pairs])
    if message is not None:
        raise ValueError(message)
    return [pair[1] for pair in gathered_pairs]


def announce(door: Any, model: Module, precision: tuple[str, str], show: bool = True) -> None:
    """Once the model is set up: every rank checks that all ranks wrapped it alike (:func:`check_ranks_agree`), then
    rank 0 prints the configuration table (when ``show``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    held_per_rank = check_ranks_agree(door, model)
    if show and door.global_rank == 0:
        rank_zero_info(configuration_table(door, model, held_per_rank, precision))
