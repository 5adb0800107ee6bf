"""Atomic commits: a checkpoint becomes visible under its final name only once it is complete.

Writers put everything into a staging sibling (``.<name>.partial``); the committer fsyncs it, then renames it into
place. A directory that already exists under the final name is first moved to ``.<name>.old`` and deleted only after
the new one is in place; :func:`recover` puts it back if a crash fell between the two renames. Nothing here knows
about state-dict formats.

On a URL (:class:`.files.Remote`; an object store has no atomic rename) the same functions keep the same promises
another way. Writers put everything under a fresh generation, ``.<name>.gen-<token>`` beside the name (a folder, or
one object for a full checkpoint); once every rank has written, rank 0 writes the *commit record* at the name itself:
a small JSON object naming the generation. A single object appears whole or not at all, so a checkpoint is visible
exactly when its record is: :func:`committed` follows the record, and a name without one is no checkpoint of this
package's (a plain object or folder under it is read as it is). The previous generation is deleted only after the new
record is in place; generations no record names (an interrupted save's) are deleted by the next save to the same name
(:func:`prepare_staging`), and :func:`remove_checkpoint` deletes the record first, then its generation.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from lightning_gaudi_fsdp.checkpoint import files
from lightning_gaudi_fsdp.checkpoint.files import Remote, Where

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"
GENERATION_INFIX = ".gen-"  # a URL checkpoint's data: .<name>.gen-<token>
RECORD_KEY = "lightning_gaudi_fsdp_commit"  # in the commit record at a URL checkpoint's name
_RECORD_MAX_BYTES = 64 * 1024


def staging_path(path: str | os.PathLike[str] | Remote, token: str = "") -> Where:
    """Where a save to ``path`` writes before it commits: ``.<name>.partial`` beside a local path; at a URL, the
    generation ``.<name>.gen-<token>`` (``token``: the same on every rank, new for each save)."""
    if isinstance(path, Remote):
        if not token:
            raise ValueError(f"a save to the URL {str(path)!r} needs a generation token")
        return path.with_name(f".{path.name}{GENERATION_INFIX}{token}")
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


# --------------------------------------------------------------------------------------- URLs: the commit record
def read_record(path: Remote) -> dict[str, Any] | None:
    """The commit record at ``path``, or None (nothing there, a folder, or an object that is no record)."""
    try:
        if not path.is_file() or files.size(path) > _RECORD_MAX_BYTES:
            return None
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get(RECORD_KEY) == 1 else None


def committed(path: Where) -> Where:
    """Where the committed checkpoint named ``path`` lies: ``path`` itself for a local path and for a URL without a
    commit record (a plain object or folder), else the generation its record names."""
    if not isinstance(path, Remote):
        return path
    record = read_record(path)
    return path if record is None else path.with_name(str(record["data"]))


def generations(path: Remote) -> list[Remote]:
    """Every generation of the checkpoint named ``path`` in its folder, committed or not."""
    prefix = f".{path.name}{GENERATION_INFIX}"
    return [path.with_name(name) for name in files.listdir(path.parent) if name.startswith(prefix)]


def _uncommitted(path: Remote, keep: Where | None) -> list[Remote]:
    current = committed(path)
    return [g for g in generations(path) if g != current and g != keep]


def _commit_remote(staging: Remote, path: Remote) -> Remote:
    record = {RECORD_KEY: 1, "data": staging.name, "directory": staging.is_dir(), "time": time.time()}
    previous = committed(path)
    path.write_bytes(json.dumps(record).encode())  # the commit: one small object, written whole or not at all
    try:
        for old in {*_uncommitted(path, staging), *([previous] if previous != path else [])}:
            files.remove(old)
    except OSError as err:
        log.warning(f"checkpoint {str(path)!r} is committed, but deleting the generation it replaces failed: {err}")
    return path


def remove_checkpoint(path: Where) -> None:
    """Delete the checkpoint named ``path`` whole: at a URL, its record first (it is then no checkpoint), then every
    generation of it."""
    if not isinstance(path, Remote):
        files.remove(path)
        return
    old = generations(path)
    files.remove(path)
    for generation in old:
        files.remove(generation)


def _old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{OLD_SUFFIX}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prepare_staging(path: str | os.PathLike[str] | Remote, directory: bool, staging: Where | None = None) -> Where:
    """Clear what an interrupted save may have left, and return an empty staging location (``staging``: the one
    :func:`staging_path` gave, needed for a URL)."""
    if isinstance(path, Remote):
        if not isinstance(staging, Remote):
            raise TypeError(f"a save to the URL {str(path)!r} needs its generation (commit.staging_path)")
        for leftover in _uncommitted(path, None):
            files.remove(leftover)
        files.remove(staging)
        return staging
    staging = staging_path(path)
    staging.parent.mkdir(parents=True, exist_ok=True)
    _remove(staging)
    if directory:
        staging.mkdir()
    return staging


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` (or the file itself) and the directories holding them."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    dirs = {path if path.is_dir() else path.parent} | {f.parent for f in files}
    for directory in dirs:
        _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Where, path: str | os.PathLike[str] | Remote) -> Where:
    """Make ``staging`` visible as ``path``; the previous content of ``path`` is replaced only once the new is in.

    Either it raises and ``path`` holds what it held before, or the new content is in place: failing to delete the
    replaced content or to flush the parent directory afterwards is logged, not raised."""
    if isinstance(path, Remote) and isinstance(staging, Remote):
        return _commit_remote(staging, path)
    if isinstance(path, Remote) or isinstance(staging, Remote):
        raise TypeError(f"cannot commit {str(staging)!r} as {str(path)!r}: one is a URL, the other a local path")
    path = Path(path)
    fsync_tree(staging)
    old = _old_path(path)
    if staging.is_file() and not path.is_dir():
        os.replace(staging, path)
    else:
        _remove(old)
        if path.exists() or path.is_symlink():
            os.replace(path, old)
        try:
            os.replace(staging, path)
        except OSError:
            if old.exists() and not path.exists():
                os.replace(old, path)
            raise
    try:
        _remove(old)
        _fsync_dir(path.parent)
    except OSError as err:
        log.warning(f"checkpoint {str(path)!r} is committed, but tidying up after it failed: {err}")
    return path


def recover(path: str | os.PathLike[str]) -> None:
    """Restore ``path`` from ``.<name>.old`` when a crash happened between the two renames of :func:`commit`.

    Every rank may call this for the same path at once (a shared file system): the rank that loses the race to
    another rank's restore finds the ``.old`` gone and ``path`` in place, which is success, not an error. Nothing to
    do at a URL (no renames there)."""
    if isinstance(path, Remote):
        return
    path = Path(path)
    old = _old_path(path)
    if not path.exists() and old.exists():
        try:
            os.replace(old, path)
        except FileNotFoundError:
            if not path.exists():
                raise


def discard(path: str | os.PathLike[str] | Remote) -> None:
    """Drop a staging location after a failed save (the committed checkpoint, if any, is left alone); at a URL, every
    generation no record names."""
    if isinstance(path, Remote):
        for leftover in _uncommitted(path, None):
            files.remove(leftover)
        return
    _remove(staging_path(path))
