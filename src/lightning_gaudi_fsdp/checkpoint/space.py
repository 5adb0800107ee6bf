"""How much a save writes and where it goes: the size estimate each rank makes before a save, the file system it
writes to, and whether the free-space check runs.

Before anything is written, every rank reports the bytes it is about to write (:func:`estimate_bytes`) and the free
space of its target file system (:func:`probe`); :func:`.storage.write_atomically` refuses a save that a file system
cannot hold (:func:`.storage.shortfalls`), and saves without the check, with a warning, where a rank's estimate fails.
``check_free_space=False`` on the strategy (or ``convert``), or ``LIGHTNING_GAUDI_FSDP_CHECK_FREE_SPACE=0``, turns that
check off for file systems that report free space wrongly (:func:`check_free_space_enabled`). Ranks write to one file
system when they read the same :func:`file_system_id` (the running kernel and the device: pods of one node sharing a
volume, whatever their host names); the streamed full save (:mod:`.streaming`) tells the same way whether another rank
sees rank 0's file, and where it may write into it (:func:`mount_of`). Nothing here knows state-dict formats or how a
failed save is reported.
"""

from __future__ import annotations

import os
import pickle
import re
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
_BOOT_ID = "/proc/sys/kernel/random/boot_id"  # the same on every process of one running kernel, and only there
MOUNTS = "/proc/self/mountinfo"  # the file systems this process sees, where and of which type


def boot_id() -> int:
    """60 bits of the running kernel's boot id (0: unknown): processes that read the same one share a kernel (one
    node, whatever its containers or pods call themselves)."""
    try:
        with open(_BOOT_ID) as handle:
            return int(handle.read().strip().replace("-", "")[:15], 16)
    except (OSError, ValueError):
        return 0


def file_system_id(stat: os.stat_result) -> tuple[int, int]:
    """What identifies the file system holding the file or directory ``stat`` describes, across processes: the
    running kernel (:func:`boot_id`, 0 if unknown) and the device number it gives that file system. Processes in
    different pods or containers of one node that mount the same volume get the same pair; other nodes another."""
    return boot_id(), stat.st_dev


def mount_of(path: str) -> tuple[str, str]:
    """The mount point and file-system type (``"ext4"``, ``"fuse.gcsfuse"``...) of the deepest mount above the
    absolute, resolved ``path`` in :data:`MOUNTS`; ``("", "")`` if unknown. Names are read as the OS gives them
    (undecodable bytes as :func:`os.fsdecode` makes them)."""
    deepest, kind = "", ""
    try:
        with open(MOUNTS, "rb") as handle:
            for line in handle:
                fields = line.split()
                point = os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda octal: bytes([int(octal.group(1), 8)]), fields[4]))
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(deepest):
                    deepest, kind = point, os.fsdecode(fields[fields.index(b"-", 6) + 1])
    except (OSError, ValueError, IndexError):
        return "", ""
    return deepest, kind


@dataclass(frozen=True)
class Target:
    """The file system a rank writes to, as that rank sees it before the save."""

    host: str
    boot: int  # see file_system_id
    device: int
    mount: str
    free: int

    @property
    def file_system(self) -> tuple[int | str, int]:
        """What identifies this file system among the ranks' targets (:func:`file_system_id`; the host name in place
        of an unknown boot id)."""
        return self.boot or self.host, self.device


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
    point = mount_of(os.path.realpath(path))[0]
    if point:
        return Path(point)
    while not os.path.ismount(path) and path != path.parent:  # no mount table to read
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    vfs = os.statvfs(nearest_existing(path))
    return vfs.f_bavail * vfs.f_frsize


def read_only(path: Path) -> bool:
    return bool(os.statvfs(nearest_existing(path)).f_flag & os.ST_RDONLY)


def probe(path: Path) -> Target:
    """The file system holding ``path`` (or its nearest existing parent): host, what identifies it
    (:func:`file_system_id`), mount point, free bytes."""
    existing = nearest_existing(path)
    boot, device = file_system_id(os.stat(existing))
    return Target(socket.gethostname(), boot, device, str(mount_point(existing)), free_bytes(existing))


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"


def same_file_system(plans: Sequence[Plan], target: Target) -> list[Plan]:
    return [p for p in plans if p.target.file_system == target.file_system]


def needed_together(plans: Sequence[Plan]) -> int | None:
    """The bytes ``plans`` write together; None when any of their estimates failed."""
    sizes = [p.needed for p in plans]
    return None if None in sizes else sum(sizes)  # type: ignore[arg-type]
