"""The storage seam: every byte of a checkpoint is read or written through here, local paths and URLs alike.

A checkpoint location is a :data:`Where`: a :class:`pathlib.Path` on a local (or mounted) file system, or a
:class:`Remote`, a URL that an fsspec file system opens (``s3://bucket/run/last.ckpt``; S3 is the one tested). A
:class:`Remote` behaves like the part of ``pathlib.Path`` the checkpoint code uses (``/``, ``name``, ``parent``,
``with_name``, ``exists``, ``is_file``, ``is_dir``, ``iterdir``, ``read_text``...), and has no ``__fspath__``:
``open(remote)`` or ``torch.load(remote)`` fails instead of writing a local folder named ``s3:``.

The API (small and stable; other modules, such as checksums, wrap it rather than add to it):

- :func:`locate` (``value, argument, call``): what a user gave, as a :data:`Where`; refuses, with
  :class:`~.location.CheckpointURLError`, a URL no installed fsspec file system opens, an unknown protocol, and a local
  path holding a flattened URL (a folder named ``s3:``). Nothing is read.
- :func:`open_read` / :func:`open_write`: binary file objects (local: the builtin ``open``, today's code path);
  :func:`exists`, :func:`is_file`, :func:`is_dir`, :func:`listdir` (names), :func:`size`, :func:`remove` (a file or a
  whole tree, nothing if absent), :func:`is_remote`.
- :func:`dcp_writer` / :func:`dcp_reader_on`: torch's distributed-checkpoint writer and reader (its file-system ones
  for a ``Path``, its fsspec ones for a :class:`Remote`, through :mod:`.adapters.torch_internals`), whose every file is
  opened by :func:`dcp_stream`, that is by :func:`open_read` / :func:`open_write`. So wrapping those two functions
  (checksums, say) covers every file of every format, DCP's included.

Speed-critical local paths stay as they were: for a ``Path`` the streamed full save keeps its in-place ``pwrite``
route (it checks :func:`is_remote`), and the fast sharded load and every other reader open the file with the builtin
``open`` as before (memory-mapped loads stay memory-mapped). Credentials and the
endpoint come the standard way (``AWS_*`` variables, ``AWS_ENDPOINT_URL``, profiles: s3fs reads them). s3fs is
imported only when an ``s3://`` URL is used; without it the error names ``pip install lightning-gaudi-fsdp[s3]``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Union

from lightning_gaudi_fsdp.checkpoint import location
from lightning_gaudi_fsdp.checkpoint.location import CheckpointURLError

_IN_PROCESS = ("memory",)  # fsspec file systems no other process sees: no other rank, no later run
_EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", None), "gcs": ("gcsfs", None)}


@functools.cache
def _file_system(protocol: str) -> Any:
    import fsspec

    # no listing cache: other ranks and hosts write the same folders, and a stale listing would hide their objects
    options = {"use_listings_cache": False} if protocol in ("s3", "s3a", "gs", "gcs") else {}
    return fsspec.filesystem(protocol, **options)


class Remote:
    """A checkpoint location at an fsspec URL (``protocol://rest``), path-like (see the module docstring)."""

    __slots__ = ("protocol", "key")

    def __init__(self, protocol: str, key: str) -> None:
        self.protocol = protocol
        self.key = key.rstrip("/")  # the file system's own path: ``bucket/run/last.ckpt``

    @property
    def fs(self) -> Any:
        return _file_system(self.protocol)

    @property
    def url(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remote) and (self.protocol, self.key) == (other.protocol, other.key)

    def __hash__(self) -> int:
        return hash((self.protocol, self.key))

    def __truediv__(self, name: str | os.PathLike[str]) -> Remote:
        return Remote(self.protocol, posixpath.join(self.key, os.fspath(name)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> Remote:
        return Remote(self.protocol, posixpath.dirname(self.key))

    def with_name(self, name: str) -> Remote:
        return self.parent / name

    def expanduser(self) -> Remote:
        return self

    def exists(self) -> bool:
        return bool(self.fs.exists(self.key))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.key))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.key))

    def iterdir(self) -> Iterator[Remote]:
        return iter([self / name for name in listdir(self)])

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.key))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.key, data)
        _forget_listings(self)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())


def _forget_listings(where: Remote) -> None:
    """fsspec's default client of ``where``'s protocol, the one Lightning's ``ModelCheckpoint`` uses, caches folder
    listings; after a commit or a removal it forgets the folder's, or it would answer ``exists`` from before it (and
    ``ModelCheckpoint`` would write ``ckpt.ckpt`` again where a local folder gets ``ckpt-v1.ckpt``)."""
    import fsspec

    with contextlib.suppress(Exception):
        fsspec.filesystem(where.protocol).invalidate_cache(where.parent.key)


Where = Union[Path, Remote]  # noqa: UP007 - a runtime alias


def _require(protocol: str, text: str, argument: str, shown: str) -> None:
    package, extra = _EXTRAS.get(protocol, (None, None))
    try:
        _file_system(protocol)
    except ImportError as err:
        how = f"pip install lightning-gaudi-fsdp[{extra}]" if extra else f"pip install {package or 'the package'}"
        raise CheckpointURLError(
            f"{shown}{argument}={text!r} is a {protocol!r} URL, which needs {package or 'an fsspec implementation'} "
            f"({err}): {how}"
        ) from None
    except ValueError:  # fsspec: "Protocol not known"
        raise CheckpointURLError(
            f"{shown}{argument}={text!r}: no fsspec file system is known for {protocol + '://'!r} URLs; "
            f"{location.ADVICE}"
        ) from None


def locate(value: str | os.PathLike[str] | Where, argument: str, call: str = "") -> Where:
    """``value`` as a :data:`Where`: a :class:`Remote` for a URL an fsspec file system opens (its package imported
    now), else the local path :func:`.location.local_path` makes (``file://`` URLs too). Raises
    :class:`~.location.CheckpointURLError` naming ``call``, ``argument`` and the value for anything else."""
    if isinstance(value, Remote):
        return value
    shown = f"{call}: " if call else ""
    text = os.fspath(value)
    protocol = location.url_protocol(text)
    if protocol is None or protocol in location.LOCAL or not text.startswith(f"{protocol}://"):
        return location.local_path(text, argument, call)  # chains ("simplecache::s3://") refused there
    if protocol in _IN_PROCESS:
        raise CheckpointURLError(
            f"{shown}{argument}={text!r}: a {protocol + '://'!r} file system lives inside one process, where the "
            f"other ranks and a later run cannot read it; {location.ADVICE}"
        )
    _require(protocol, text, argument, shown)
    key = text[len(protocol) + 3 :]
    if not key.strip("/"):
        raise CheckpointURLError(f"{shown}{argument}={text!r} names no bucket or path")
    return Remote(protocol, key)


def is_remote(where: Any) -> bool:
    return isinstance(where, Remote)


def open_read(where: Where, buffering: int = -1) -> IO[bytes]:
    if isinstance(where, Remote):
        return where.fs.open(where.key, "rb")
    return open(where, "rb", buffering=buffering)  # noqa: SIM115 - the caller closes it


def open_write(where: Where) -> IO[bytes]:
    """A new binary file at ``where`` (replaced if present); on a URL it is visible once closed (S3: s3fs's multipart
    upload, one part of its block size at a time, completed on close)."""
    if isinstance(where, Remote):
        return where.fs.open(where.key, "wb")
    return open(where, "wb")  # noqa: SIM115 - the caller closes it


def exists(where: Where) -> bool:
    return where.exists()


def is_file(where: Where) -> bool:
    return where.is_file()


def is_dir(where: Where) -> bool:
    return where.is_dir()


def size(where: Where) -> int:
    """The bytes of the file at ``where``, or of every file under the folder at ``where``."""
    if isinstance(where, Remote):
        return int(where.fs.du(where.key, total=True)) if where.is_dir() else int(where.fs.size(where.key))
    if where.is_dir():
        return sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
    return where.stat().st_size


def listdir(where: Where) -> list[str]:
    """The names directly under ``where`` (none if it is no folder)."""
    if isinstance(where, Remote):
        try:
            entries = where.fs.ls(where.key, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries if e.rstrip("/") != where.key)
    return sorted(p.name for p in where.iterdir()) if where.is_dir() else []


def remove(where: Where) -> None:
    """Delete ``where``, a file or a whole tree; nothing if it is absent."""
    if isinstance(where, Remote):
        with contextlib.suppress(FileNotFoundError):
            where.fs.rm(where.key, recursive=True)
        _forget_listings(where)
        return
    import shutil

    if where.is_dir() and not where.is_symlink():
        shutil.rmtree(where)
    elif where.exists() or where.is_symlink():
        where.unlink()


def dcp_stream(path: str | os.PathLike[str], mode: str) -> IO[bytes]:
    """A file of a distributed checkpoint, opened for torch's DCP reader or writer (``path``: the local path or URL
    it names, ``mode`` ``"rb"`` or ``"wb"``): through :func:`open_read` / :func:`open_write` like every other file."""
    where = path if isinstance(path, Path) else locate(path, "path")
    return open_write(where) if "w" in mode else open_read(where)


def dcp_writer(where: Where) -> Any:
    """torch's distributed-checkpoint writer into the folder at ``where``; every file it writes goes through
    :func:`dcp_stream`."""
    from lightning_gaudi_fsdp.adapters import torch_internals

    return torch_internals.dcp_writer(str(where), isinstance(where, Remote), dcp_stream)


def dcp_reader_on(reader: Any, where: Where) -> Any:
    """Have ``reader`` (torch's ``FileSystemReader``, or a subclass, made for ``where``) read every file through
    :func:`dcp_stream`; at a URL, through fsspec."""
    from lightning_gaudi_fsdp.adapters import torch_internals

    if isinstance(where, Remote):
        torch_internals.read_through_fsspec(reader, where.url)
    return torch_internals.route_dcp_streams(reader, dcp_stream)


def probe(where: Remote, argument: str, call: str = "") -> None:
    """Fail now, naming the URL and the cause, when the bucket of ``where`` is missing or the credentials are refused
    (before training starts, not at the first save)."""
    bucket = where.key.split("/", 1)[0]
    try:
        where.fs.invalidate_cache()
        where.fs.ls(bucket, detail=False)
    except FileNotFoundError as err:
        raise CheckpointURLError(
            f"{call + ': ' if call else ''}{argument}={where.url!r}: the bucket {bucket!r} does not exist or is not "
            f"reachable ({err})"
        ) from None
    except (PermissionError, OSError) as err:
        raise CheckpointURLError(
            f"{call + ': ' if call else ''}{argument}={where.url!r}: access refused ({type(err).__name__}: {err}); "
            "check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE) and AWS_ENDPOINT_URL"
        ) from None
