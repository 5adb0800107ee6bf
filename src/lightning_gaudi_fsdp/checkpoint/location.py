"""Where a checkpoint may be: a local path, or a URL (see :mod:`.files`), never a URL taken for a local path.

Every place a user hands the package a checkpoint location turns it into a :data:`.files.Where` with
:func:`.files.locate`, which takes ``protocol://...`` URLs an fsspec file system opens, and gives the rest to
:func:`local_path` (also used directly where a URL is not taken yet: ``export_hf``'s destination and
``hf_config``). A
``file://`` (or fsspec's ``local://``) URL becomes the path it names. Any other URL is refused there with
:class:`CheckpointURLError`, before anything is read or written: ``pathlib.Path("s3://ckpt/x.ckpt")`` is the relative
path ``s3:/ckpt/x.ckpt``, and a save there would write a folder named ``s3:`` under the working directory and report
success. The same error refuses a path in which such a URL was already flattened (a folder named after a protocol,
such as ``s3:``; Lightning's ``ModelCheckpoint`` turns ``dirpath="file:///x"`` into ``<cwd>/file:/x``), so the
writers and readers, which call it too, never take one either. Nothing here reads the file system.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path, PurePath

LOCAL = ("file", "local")  # fsspec's names of the local file system
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-_]*")
ADVICE = (
    "this argument takes a local path or a URL of the form protocol://bucket/path that an installed fsspec file system "
    "opens (s3:// with lightning-gaudi-fsdp[s3]), and nothing was read or written; see docs/checkpoints.md, "
    '"Checkpoints on object storage"'
)


LOCAL_ONLY_ADVICE = (
    "this argument takes a local path (or a file:// URL) only, not a URL yet, and nothing was read or written. Pass a "
    "local path, or the path where the bucket is mounted as a file system; see docs/checkpoints.md, "
    '"Where checkpoints go"'
)


class CheckpointURLError(ValueError):
    """A checkpoint location that cannot be honoured: a URL where this argument takes none, a URL no installed fsspec
    file system opens (a chain such as ``simplecache::s3://``, an unknown protocol), or a flattened URL."""


@functools.cache
def _protocols() -> frozenset[str]:
    import fsspec

    return frozenset(fsspec.available_protocols())


def url_protocol(location: str | os.PathLike[str]) -> str | None:
    """The protocol of ``location`` when it is a URL (``"s3"``, ``"file"``, ``"simplecache"`` for a chain), else
    None (a plain path)."""
    from fsspec.utils import get_protocol

    text = os.fspath(location)
    if not isinstance(text, str) or ("://" not in text and "::" not in text):
        return None
    protocol = get_protocol(text)
    if not _SCHEME.fullmatch(protocol):
        return None
    if text.startswith(f"{protocol}://"):
        return protocol
    return protocol if protocol in _protocols() else None  # a chain ("simplecache::s3://..."), not "my::file"


def _flattened(path: str) -> str | None:
    """The first folder of ``path`` named like a URL's protocol (``s3:``): a URL that became a local path."""
    protocols = _protocols()
    return next((part for part in PurePath(path).parts if part.endswith(":") and part[:-1] in protocols), None)


def local_path(location: str | os.PathLike[str], argument: str, call: str = "", urls: bool = True) -> Path:
    """``location`` as a local path: a plain path as given, a ``file://`` URL as the path it names. Raises
    :class:`CheckpointURLError` for any other URL, or a path holding a flattened one, naming ``call``
    (``"fabric.save"``; none for a function's own argument), ``argument`` and the value as given. ``urls``: whether
    the argument takes URLs elsewhere (:func:`.files.locate`), which the advice says."""
    shown = f"{call}: " if call else ""
    advice = ADVICE if urls else LOCAL_ONLY_ADVICE
    protocol = url_protocol(location)
    text = os.fspath(location)
    if protocol in LOCAL and text.startswith(f"{protocol}://"):
        text = text[len(protocol) + 3 :]
    elif protocol is not None:
        scheme = f"{protocol}://" if text.startswith(f"{protocol}://") else f"{protocol}::"
        raise CheckpointURLError(f"{shown}{argument}={text!r} is a URL ({scheme!r}): {advice}")
    folder = _flattened(text)
    if folder is not None:
        raise CheckpointURLError(
            f"{shown}{argument}={text!r} has a folder named {folder!r}: a {folder[:-1] + '://'!r} URL flattened into a "
            "local path (pathlib.Path('s3://b/x') is 's3:/b/x'; Lightning's ModelCheckpoint turns dirpath='file:///x' "
            f"into a folder 'file:' under the working directory): {advice}"
        )
    return Path(text)
