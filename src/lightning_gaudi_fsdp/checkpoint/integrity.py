"""Verified checkpoints: the manifest of a checkpoint's checksums, and :func:`verify`.

Every save records a checksum of every byte it writes, computed while writing (see :mod:`.checksum`): a single-file
checkpoint carries its digests in its own zip comment; a directory checkpoint (sharded, local) lists every file's
digests in :data:`MANIFEST`, written into the staging directory before the commit makes the checkpoint visible.

:func:`verify` reads a committed checkpoint back and compares: a missing file, a file of another size (truncated) and
a changed byte all raise :class:`CheckpointIntegrityError`, naming the file, the entry the damage is in (a tensor of a
distributed-checkpoint file, a record of a ``torch.save`` archive), the expected and the found value, and the newest
earlier checkpoint beside it that verifies, if any (it is never loaded instead: that would lose steps silently).
Several ranks share the reading (``rank``/``world_size``): each reads one contiguous part of the checkpoint's bytes,
in the order :func:`verify` with one process reads them, so the first damage any rank finds is the first damage
there is. A checkpoint without checksums (an earlier release, Lightning's own, a plain state dict) returns ``False``.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from lightning_gaudi_fsdp.checkpoint import checksum, files
from lightning_gaudi_fsdp.checkpoint.checksum import Digest
from lightning_gaudi_fsdp.checkpoint.files import Remote, Where
from lightning_gaudi_fsdp.checkpoint.formats import CheckpointError, CheckpointFormat, detect_format, readable

log = logging.getLogger(__name__)

MANIFEST = checksum.MANIFEST
NOT_VERIFIED = (
    "checkpoint {path!r} carries no checksums (written by an earlier release, by Lightning itself, or with "
    "verify_checkpoints=False): loading it without verification"
)


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint whose bytes are not those that were saved: raised before anything is loaded, on every rank."""

    def __init__(self, path: str | os.PathLike[str], problem: str, file: str | None = None) -> None:
        super().__init__(path, problem)
        self.file = file

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.path, self.problem, self.file)


# ------------------------------------------------------------------------------------------------------- manifest
def _read_manifest(path: Where) -> dict[str, Digest] | None:
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        with files.open_read(file) as handle:
            data = json.loads(handle.read())
        if data.get("algorithm") != checksum.ALGORITHM:
            raise ValueError(f"algorithm {data.get('algorithm')!r}, this release checks {checksum.ALGORITHM!r}")
        return {name: Digest.from_json(entry) for name, entry in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointIntegrityError(path, f"file {MANIFEST!r} (its checksums) is damaged: {err}", MANIFEST) from err


@dataclass(frozen=True)
class _Unit:
    """One file to verify: ``name`` relative to the checkpoint, ``file`` on disk, the first ``covered`` bytes
    hashed (a trailer's own comment is not), ``trailer``: the digests were read from the file itself."""

    name: str
    file: Where
    digest: Digest
    covered: int
    trailer: bool


def _units(path: Where) -> list[_Unit] | None:
    """What to verify in the checkpoint at ``path`` (file or directory); None: it carries no checksums."""
    if path.is_file():
        try:
            found = checksum.read_trailer(path)
        except checksum.TrailerDamaged as err:
            problem = f"checksum verification failed: file {path.name!r} is truncated or damaged at its end: {err}"
            raise CheckpointIntegrityError(path, problem, path.name) from err
        if found is None:
            return None
        digest, covered = found
        return [_Unit(path.name, path, digest, covered, True)]
    files = _read_manifest(path)
    if files is None:
        return None
    return [_Unit(name, path / name, digest, digest.size, False) for name, digest in sorted(files.items())]


def carries_checksums(path: str | os.PathLike[str] | Where) -> bool:
    try:
        return _units(readable(path)) is not None
    except CheckpointIntegrityError:
        return True


# ------------------------------------------------------------------------------------------------------ verifying
def verify(path: str | os.PathLike[str] | Where, *, rank: int = 0, world_size: int = 1, earlier: bool = True) -> bool:
    """Check ``path`` against its recorded checksums: this rank's part of it (see the module's docstring). Returns
    False when it carries none; raises :class:`CheckpointIntegrityError` on the first damage in this rank's part
    (with ``earlier``: naming the newest earlier checkpoint beside it that verifies)."""
    path = readable(path)
    try:
        units = _units(path)
        if units is None:
            return False
        for unit, blocks, owns_start in _share(units, rank, world_size):
            _check_unit(path, unit, blocks, owns_start)
    except CheckpointIntegrityError as err:
        if not earlier:
            raise
        raise CheckpointIntegrityError(path, err.problem + _earlier_note(path), err.file) from None
    return True


def format_of(path: str | os.PathLike[str] | Where) -> CheckpointFormat:
    """:func:`.formats.detect_format`, except that a directory checkpoint whose checksums list a file that is missing
    or of another size (its ``meta.pt`` or ``local_metadata.json`` gone, which names its format) raises
    :class:`CheckpointIntegrityError` naming that file, as :func:`verify` would (reading no byte)."""
    try:
        return detect_format(path)
    except CheckpointError:
        found = readable(path)
        try:
            units = _units(found) if found.is_dir() else None
            for unit in units or ():
                _check_unit(found, unit, [], True)
        except CheckpointIntegrityError as err:
            raise CheckpointIntegrityError(found, err.problem + _earlier_note(found), err.file) from None
        raise


def verify_offline(path: str | os.PathLike[str] | Where, notes: list[str] | None = None) -> bool:
    """:func:`verify` in one process, for the offline tools (``inspect``, ``convert``, ``export_hf``): raises on
    damage; a checkpoint without checksums adds the "not verified" line to ``notes`` (else logs it)."""
    if verify(path):
        return True
    line = NOT_VERIFIED.format(path=str(path))
    if notes is None:
        log.warning(line)
    else:
        notes.append(line)
    return False


def _share(units: list[_Unit], rank: int, world_size: int) -> Iterator[tuple[_Unit, list[tuple[int, int, int]], bool]]:
    """This rank's part: the blocks ``(index, start, end)`` of each file that start in its contiguous range of the
    checkpoint's bytes; ``owns_start``: it also checks the file is there with its size."""
    total = sum(u.covered for u in units)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size

    def mine(at: int) -> bool:
        return lo <= at < hi or (rank == world_size - 1 and at >= total)

    offset = 0
    for unit in units:
        ranges = unit.digest.ranges(unit.covered)
        blocks = [(i, start, end) for i, (start, end) in enumerate(ranges) if mine(offset + start)]
        owns_start = mine(offset)
        if blocks or owns_start:
            yield unit, blocks, owns_start
        offset += unit.covered


def _check_unit(path: Where, unit: _Unit, blocks: list[tuple[int, int, int]], owns_start: bool) -> None:
    def fail(problem: str) -> CheckpointIntegrityError:
        return CheckpointIntegrityError(path, f"checksum verification failed: file {unit.name!r} {problem}", unit.name)

    if not unit.file.is_file():
        raise fail("is missing")
    size = files.size(unit.file)
    expected = unit.digest.size if not unit.trailer else size  # a trailer's own length was checked when read
    if size != expected:  # every rank with a part of it says so (it cannot read its part as written)
        shorter = "is truncated: " if size < expected else "has another size: "
        raise fail(f"{shorter}expected {expected} bytes, found {size}")
    with files.open_read(unit.file) as handle:
        for index, start, end in blocks:
            handle.seek(start)
            data = handle.read(end - start)
            if unit.trailer and end == unit.covered:
                data = data[:-2] + b"\0\0"  # the digest covers the end record without its comment's length
            found = xxhash.xxh3_64(data).digest()
            wanted = unit.digest.block_digest(index)
            if found != wanted:
                entry = _entry_at(path, unit, start, end)
                raise fail(
                    f"{entry}(bytes {start} to {end}) does not match: expected {checksum.ALGORITHM} "
                    f"{wanted.hex()}, found {found.hex()}"
                )


def _entry_at(path: Where, unit: _Unit, start: int, end: int) -> str:
    """The entries of ``unit`` in bytes ``start`` to ``end``, in words ("entry 'model.w' "), or "" if unknown."""
    names: list[str] = []
    try:
        if isinstance(path, Remote):
            return ""
        if unit.name.endswith(".distcp"):
            from torch.distributed.checkpoint import FileSystemReader

            metadata = FileSystemReader(str(path)).read_metadata()
            for key, info in metadata.storage_data.items():
                if info.relative_path == unit.name and info.offset < end and start < info.offset + info.length:
                    names.append(f"{key.fqn} (from {tuple(key.offset)})" if any(key.offset) else key.fqn)
        else:
            with zipfile.ZipFile(unit.file) as archive:
                for record in archive.infolist():
                    if (
                        record.header_offset < end
                        and start < record.header_offset + 30 + len(record.filename) + record.compress_size + 64
                    ):
                        names.append(record.filename)
    except Exception:  # noqa: BLE001 - naming the entry is a courtesy; the mismatch is reported all the same
        return ""
    if not names:
        return ""
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return "entry " + ", ".join(repr(n) for n in names[:3]) + more + " "


# ------------------------------------------------------------------------------------------- an earlier checkpoint
def _earlier_note(path: Where) -> str:
    if isinstance(path, Remote):
        return "; nothing was loaded (earlier checkpoints at a URL are not searched)"
    found = newest_earlier_verified(path)
    if found is None:
        return f". No earlier checkpoint with checksums in {str(path.parent)!r} verifies; nothing was loaded"
    return (
        f". The newest earlier checkpoint that verifies is {str(found)!r}; nothing was loaded (resume from it "
        "explicitly if you want its steps)"
    )


def newest_earlier_verified(path: Path) -> Path | None:
    """The newest checkpoint written before ``path`` in its directory that carries checksums and verifies."""
    try:
        mine = path.stat().st_mtime if path.exists() else float("inf")
        siblings = [p for p in path.parent.iterdir() if p != path and not p.name.startswith(".")]
    except OSError:
        return None
    candidates = []
    for sibling in siblings:
        try:
            if sibling.stat().st_mtime <= mine and carries_checksums(sibling):
                candidates.append((sibling.stat().st_mtime, sibling))
        except OSError:
            continue
    for _, candidate in sorted(candidates, key=lambda item: item[0], reverse=True):
        try:
            if verify(candidate, earlier=False):
                return candidate
        except (CheckpointError, OSError):
            continue
    return None
