"""Atomic commits: a checkpoint becomes visible under its final name only once it is complete.

Writers put everything into a staging sibling (``.<name>.partial``); the committer fsyncs it, then renames it into
place. A directory that already exists under the final name is first moved to ``.<name>.old`` and deleted only after
the new one is in place; :func:`recover` puts it back if a crash fell between the two renames. Nothing here knows
about state-dict formats.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"


def staging_path(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


def _old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{OLD_SUFFIX}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prepare_staging(path: str | os.PathLike[str], directory: bool) -> Path:
    """Clear what an interrupted save may have left, and return an empty staging location."""
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


def commit(staging: Path, path: str | os.PathLike[str]) -> Path:
    """Make ``staging`` visible as ``path``; the previous content of ``path`` is replaced only once the new is in.

    Either it raises and ``path`` holds what it held before, or the new content is in place: failing to delete the
    replaced content or to flush the parent directory afterwards is logged, not raised."""
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
    another rank's restore finds the ``.old`` gone and ``path`` in place, which is success, not an error."""
    path = Path(path)
    old = _old_path(path)
    if not path.exists() and old.exists():
        try:
            os.replace(old, path)
        except FileNotFoundError:
            if not path.exists():
                raise


def discard(path: str | os.PathLike[str]) -> None:
    """Drop a staging location after a failed save (the committed checkpoint, if any, is left alone)."""
    _remove(staging_path(path))
