"""How much a save writes and where it goes: the size estimate each rank makes before a save, the file system it
writes to, and whether the free-space check runs.

Before anything is written, every rank reports the bytes it is about to write (:func:`estimate_bytes`) and the free
space of its target file system (:func:`probe`); :func:`.storage.write_atomically` refuses a save that a file system
cannot hold (:func:`.storage.shortfalls`), and saves without the check, with a warning, where a rank's estimate fails.
``check_free_space=False`` on the strategy (or ``convert``), or ``LIGHTNING_GAUDI_FSDP_CHECK_FREE_SPACE=0``, turns that
check off for file systems that report free space wrongly (:func:`check_free_space_enabled`). Nothing here knows
state-dict formats or how a failed save is reported.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

CHECK_FREE_SPACE_ENV = "LIGHTNING_GAUDI_FSDP_CHECK_FREE_SPACE"
# Per tensor: zip record headers, alignment and rebuild arguments ("storage", torch.save); torch's distributed
# checkpoint writes each tensor as its own small torch.save archive plus its metadata entry ("elements").
_PER_TENSOR_BYTES = {"storage": 256, "elements": 2048}
_PER_FILE_BYTES = 4096  # zip or DCP framing, and the last partly used block of the file


def check_free_space_enabled(explicit: bool | None = None) -> bool:
    """Whether a save compares its size with the free space first. Precedence: ``explicit`` (the ``check_free_space``
    argument of the strategy or of ``convert``), then ``LIGHTNING_GAUDI_FSDP_CHECK_FREE_SPACE`` (``0``, ``false``,
    ``no`` or ``off`` turn the check off), then on."""
    if explicit is not None:
        return explicit
    return os.environ.get(CHECK_FREE_SPACE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# ------------------------------------------------------------------------------------------------ size estimate
class ByteCounter:
    """A file-like sink that only counts what is written to it (for pickling passes that need no output)."""

    def __init__(self) -> None:
        self.count = 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.count += size
        return size


def local_tensors(value: Any) -> list[torch.Tensor] | None:
    """The tensors this rank holds of ``value`` (a sharded or distributed tensor's local part); None for a
    non-tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    if hasattr(value, "local_shards"):  # ShardedTensor: this rank's shards
        return [shard.tensor for shard in value.local_shards()]
    if hasattr(value, "to_local"):  # DTensor
        return [value.to_local()]
    return [value]


def estimate_bytes(obj: Any, tensors: Literal["storage", "elements"] = "storage") -> int:
    """About how many bytes saving ``obj`` writes. ``"storage"``: as ``torch.save`` (each tensor's whole storage, once
    per storage); ``"elements"``: as torch's distributed checkpoint (each tensor's own elements; a sharded or
    distributed tensor counts its local part). Everything else is measured by pickling it with the tensors left out.

    Raises what that pass raises (a tensor without a storage, such as a sparse one; an object that cannot be
    pickled): a count that stopped there would be too small. A save then skips its free-space check with a warning
    (see :func:`write_atomically`)."""
    seen: set[tuple[int, int]] = set()
    totals = {"bytes": 0, "tensors": 0}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            local = local_tensors(value)
            if local is None:
                return None
            for tensor in local:
                totals["tensors"] += 1
                if tensor.is_meta:
                    continue
                if tensors == "elements":
                    totals["bytes"] += tensor.numel() * tensor.element_size()
                    continue
                storage = tensor.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key not in seen:
                    seen.add(key)
                    totals["bytes"] += storage.nbytes()
            return totals["tensors"]

    sink = ByteCounter()
    _Pickler(sink, protocol=2).dump(obj)
    return sink.count + totals["bytes"] + totals["tensors"] * _PER_TENSOR_BYTES[tensors] + _PER_FILE_BYTES


# ------------------------------------------------------------------------------------------------ file systems
@dataclass(frozen=True)
class Target:
    """The file system a rank writes to, as that rank sees it before the save."""

    host: str
    device: int
    mount: str
    free: int


@dataclass(frozen=True)
class Plan:
    """What one rank is about to write (``needed`` bytes; None: its estimate failed), and where."""

    rank: int
    target: Target
    needed: int | None
    check: bool


def nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    path = nearest_existing(path)
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    vfs = os.statvfs(nearest_existing(path))
    return vfs.f_bavail * vfs.f_frsize


def read_only(path: Path) -> bool:
    return bool(os.statvfs(nearest_existing(path)).f_flag & os.ST_RDONLY)


def probe(path: Path) -> Target:
    """The file system holding ``path`` (or its nearest existing parent): node, device, mount point, free bytes."""
    existing = nearest_existing(path)
    return Target(socket.gethostname(), os.stat(existing).st_dev, str(mount_point(existing)), free_bytes(existing))


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"


def same_file_system(plans: Sequence[Plan], target: Target) -> list[Plan]:
    return [p for p in plans if (p.target.host, p.target.device) == (target.host, target.device)]


def needed_together(plans: Sequence[Plan]) -> int | None:
    """The bytes ``plans`` write together; None when any of their estimates failed."""
    sizes = [p.needed for p in plans]
    return None if None in sizes else sum(sizes)  # type: ignore[arg-type]
