"""Checksums of checkpoint files, computed while the bytes are written: the algorithm, the write-through file and
the record of what was written.

The algorithm is XXH3-64 (the ``xxhash`` package, a maintained binding of the reference C library with wheels for
Linux x86-64 and aarch64 on every supported Python): about 10 GB/s on one core of this machine, against 3.2 GB/s for
hardware CRC32C (``google-crc32c``) and 1.4 GB/s for ``zlib.crc32``. A file is hashed in blocks (:func:`block_size`):
a damaged byte is then placed within a block, which names the entry (a tensor of a distributed-checkpoint file, a
record of a ``torch.save`` archive) it fell in.

:class:`HashingFile` wraps a binary file open for writing: every byte written goes through the hasher on its way
(never read back). Where the file is a checkpoint of its own (one ``torch.save`` file), it appends the digests to the
file as its zip comment (:func:`read_trailer` finds them), which ``torch.load``, ``zipfile`` and ``unzip`` accept;
a directory checkpoint lists its files' digests in its manifest instead (see :mod:`.integrity`). Nothing here knows
checkpoint formats.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import json
import os
import posixpath
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from lightning_gaudi_fsdp.checkpoint import files
from lightning_gaudi_fsdp.checkpoint.files import Where

ALGORITHM = "xxh3_64"
DIGEST_BYTES = 8
MIN_BLOCK = 1 << 20  # 1 MiB: the finest a damaged byte is placed
DEFAULT_BLOCK = 4 << 20  # where the file's size is not known in advance
_TRAILER_BLOCKS = 4096  # at most this many digests in a zip comment (65535 bytes at most)
_COMMENT_MAX = 65535 - 1024  # what a trailer may take of a zip comment, with room to spare
TRAILER_MAGIC = b"lightning-gaudi-fsdp checksums "
MANIFEST = "checksums.json"  # a directory checkpoint's checksums: every other file's digests
MANIFEST_VERSION = 1
_EOCD = b"PK\x05\x06"
_EOCD_SIZE = 22


def block_size(expected_bytes: int | None, parts: int = 0) -> int:
    """The block a file of about ``expected_bytes`` is hashed in: 1 MiB, doubled until the digests fit a zip
    comment (4096 blocks: 4 GiB files at 1 MiB, 4 TiB at 1 GiB), with ``parts`` pieces of it hashed by other writers
    (see :func:`trailer_fits`)."""
    if not expected_bytes:
        return DEFAULT_BLOCK
    size = MIN_BLOCK
    # some slack for an estimate that came out short
    while size < expected_bytes and (
        expected_bytes > size * (_TRAILER_BLOCKS - 64) or _comment_bytes(expected_bytes, size, parts) > _COMMENT_MAX
    ):
        size *= 2
    return size


def trailer_fits(expected_bytes: int | None, parts: int) -> bool:
    """Whether the zip comment of a file of about ``expected_bytes`` holds its digests when ``parts`` pieces of it
    are hashed by other writers (each adds up to two blocks and two cuts; the comment holds 65535 bytes): some
    thousand pieces at most, whatever the block."""
    return bool(expected_bytes) and _comment_bytes(expected_bytes, block_size(expected_bytes, parts), parts) <= (
        _COMMENT_MAX
    )


def _comment_bytes(expected_bytes: int, block: int, parts: int) -> int:
    """About the longest a trailer gets (:meth:`HashingFile.finish`), with an estimate ``expected_bytes`` that came
    out short by up to 64 blocks."""
    blocks = -(-expected_bytes // block) + 64 + 2 * parts
    cut = len(str(2 * expected_bytes)) + 1  # a cut in decimal, and its comma
    return len(TRAILER_MAGIC) + 128 + -(-blocks * DIGEST_BYTES // 3) * 4 + 2 * parts * cut


@dataclass(frozen=True)
class Digest:
    """What was written to one file: its ``size``, the digest of each block (``blocks``), the blocks being
    ``block`` bytes long except where a writer cut one short at an entry's start (``cuts``: those offsets)."""

    size: int
    block: int
    blocks: bytes  # DIGEST_BYTES per block, in order
    cuts: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = {"size": self.size, "block": self.block, ALGORITHM: base64.b64encode(self.blocks).decode("ascii")}
        if self.cuts:
            data["cuts"] = list(self.cuts)
        return data

    @classmethod
    def from_json(cls, data: Any) -> Digest:
        cuts = tuple(int(c) for c in data.get("cuts", ()))
        return cls(int(data["size"]), int(data["block"]), base64.b64decode(data[ALGORITHM]), cuts)

    def block_digest(self, index: int) -> bytes:
        return self.blocks[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]

    def ranges(self, size: int | None = None) -> list[tuple[int, int]]:
        """Each block's (start, end) in a file of ``size`` bytes (default: as written); one empty block if none."""
        size = self.size if size is None else size
        found, start, cuts = [], 0, [c for c in self.cuts if 0 < c < size]
        while start < size:
            end = min(start + self.block, size)
            while cuts and cuts[0] <= start:
                cuts.pop(0)
            if cuts and cuts[0] < end:
                end = cuts.pop(0)
            found.append((start, end))
            start = end
        return found or [(0, 0)]


class BlockHasher:
    """Hashes a stream of bytes in blocks of ``block`` bytes (or shorter, where :meth:`cut`); bytes another writer
    hashes (:meth:`skip`) are blocks of their own, their digests given later (:meth:`fill`)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.size = 0
        self._digests: list[bytes] = []
        self._cuts: list[int] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0
        self._holes: dict[Any, tuple[int, int]] = {}  # key -> (index of its first block, its blocks) not filled yet

    def update(self, data: Any) -> int:
        """Hash ``data`` (any contiguous buffer); returns its length in bytes."""
        view = memoryview(data)
        size = view.nbytes
        if size < self.block - self._filled and view.c_contiguous:  # within the block: one call (most writes)
            self._hasher.update(view)
            self._filled += size
            self.size += size
            return size
        view = view.cast("B")
        while len(view):
            take = min(len(view), self.block - self._filled)
            self._hasher.update(view[:take])
            self._filled += take
            self.size += take
            view = view[take:]
            if self._filled == self.block:
                self._close_block()
        return size

    def cut(self) -> None:
        """End the current block here (an entry starts): damage is then placed within the entry."""
        if self._filled:
            self._close_block()
            self._cuts.append(self.size)

    def skip(self, size: int, key: Any) -> None:
        """``size`` bytes written by another writer, who hashes them as a :class:`BlockHasher` of the same block
        does (:func:`block_digests`): a block ends where they start and where they end; :meth:`fill` gives their
        digests under ``key``."""
        if size <= 0:
            return
        self.cut()
        count = -(-size // self.block)
        self._holes[key] = (len(self._digests), count)
        self._digests.extend([b""] * count)
        self.size += size
        if size % self.block:
            self._cuts.append(self.size)

    def fill(self, key: Any, digests: bytes) -> None:
        """The digests of the bytes skipped under ``key`` (:meth:`skip`), as :func:`block_digests` gives them."""
        first, count = self._holes.pop(key)
        if len(digests) != count * DIGEST_BYTES:
            raise ValueError(f"{len(digests) // DIGEST_BYTES} block digests were given for {count} blocks")
        for i in range(count):
            self._digests[first + i] = digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]

    def _close_block(self) -> None:
        self._digests.append(self._hasher.digest())
        self._hasher.reset()
        self._filled = 0

    def digest(self) -> Digest:
        if self._holes:
            raise ValueError(f"the digests of {len(self._holes)} part(s) written by another writer were not given")
        tail = [self._hasher.digest()] if self._filled or not self._digests else []
        return Digest(self.size, self.block, b"".join(self._digests + tail), tuple(self._cuts))


def block_digests(data: Any, block: int) -> bytes:
    """The block digests of ``data`` written at the start of a block (see :meth:`BlockHasher.skip`)."""
    hasher = BlockHasher(block)
    hasher.update(data)
    return hasher.digest().blocks


class HashingFile:
    """A binary file open for writing that hashes what goes through it (see the module's docstring).

    ``trailer``: the file is one ``torch.save`` archive; :meth:`close` appends the digests as its zip comment (the
    archive's last 22 bytes, its end record, are held back until then to set the comment's length). ``on_close``
    receives the :class:`Digest` of everything written (with a trailer: of the file less its comment). ``entries``:
    each :meth:`tell` ends a block, as a writer that records where its entries start asks before each one."""

    def __init__(
        self, raw: BinaryIO, block: int, *, trailer: bool = False, on_close: Any = None, entries: bool = False
    ) -> None:
        self._raw = raw
        self._entries = entries and not trailer
        self._hasher = BlockHasher(block)
        self._trailer = trailer
        self._tail = b""
        self._on_close = on_close
        self.closed = False
        self.digest: Digest | None = None

    def write(self, data: Any) -> int:
        if not self._trailer:  # each write costs one call into the hasher, besides the hash itself
            size = self._hasher.update(data)
            self._raw.write(data)
            return size
        view = memoryview(data).cast("B")
        size = len(view)
        if size >= _EOCD_SIZE:  # hold back the last 22 bytes written: the end record, once the archive ends
            if self._tail:
                self._pass(self._tail)
            self._pass(view[: size - _EOCD_SIZE])
            self._tail = bytes(view[size - _EOCD_SIZE :])
        else:
            joined = self._tail + bytes(view)
            self._pass(joined[: max(0, len(joined) - _EOCD_SIZE)])
            self._tail = joined[-_EOCD_SIZE:]
        return size

    def _pass(self, data: Any) -> None:
        if len(data):
            self._hasher.update(data)
            self._raw.write(data)

    def skip(self, size: int, key: Any) -> int:
        """Leave ``size`` bytes for another writer to write at the offset returned (the raw file seeks past them),
        who hashes them (see :meth:`BlockHasher.skip`); their digests come with :meth:`fill`."""
        if self._tail:  # what was held back lies before them
            self._hasher.update(self._tail)
            self._raw.write(self._tail)
            self._tail = b""
        offset = self._hasher.size
        self._hasher.skip(size, key)
        self._raw.seek(size, os.SEEK_CUR)
        return offset

    def fill(self, key: Any, digests: bytes) -> None:
        self._hasher.fill(key, digests)

    @property
    def block(self) -> int:
        return self._hasher.block

    def tell(self) -> int:
        if self._entries:  # a writer asks where an entry starts (DCP does, before and after each): a block ends
            self._hasher.cut()
        return self._hasher.size + len(self._tail)

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def finish(self) -> Digest:
        """Write what was held back (and the trailer), and return the digest; the raw file stays open."""
        if self.digest is not None:
            return self.digest
        if self._trailer:
            tail = self._tail
            if len(tail) != _EOCD_SIZE or tail[:4] != _EOCD or tail[20:22] != b"\0\0":
                raise ValueError("a checksum trailer needs a zip archive without a comment (as torch.save writes)")
            self._hasher.update(tail)
            digest = self._hasher.digest()
            comment = TRAILER_MAGIC + json.dumps(digest.to_json(), separators=(",", ":")).encode("ascii")
            self._raw.write(tail[:20] + struct.pack("<H", len(comment)) + comment)
        else:
            digest = self._hasher.digest()
        self.digest = digest
        if self._on_close is not None:
            self._on_close(digest)
        return digest

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.finish()
        finally:
            self.closed = True
            self._raw.close()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:  # a failed write: no digest of a file that is not complete
            self.closed = True
            self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class TrailerDamaged(ValueError):
    """A file that carries a checksum trailer which cannot be read as written (a truncated or damaged end)."""


def read_trailer(path: Where) -> tuple[Digest, int] | None:
    """The digest a :class:`HashingFile` appended to the ``torch.save`` archive at ``path``, and the number of bytes
    it covers (the archive less its comment); ``None`` when it carries none. Raises :class:`TrailerDamaged` when
    its end holds a trailer that is cut short or altered."""
    end = files.size(path)
    start = max(0, end - (_EOCD_SIZE + 65535 + 1))
    with files.open_read(path) as handle:
        handle.seek(start)
        tail = handle.read()
    at = tail.rfind(TRAILER_MAGIC)
    if at < 0:
        return None
    record = at - _EOCD_SIZE
    if record < 0 or tail[record : record + 4] != _EOCD:
        raise TrailerDamaged("its checksum record is not at the end of the archive where it was written")
    (length,) = struct.unpack_from("<H", tail, record + 20)
    if record + _EOCD_SIZE + length != len(tail):
        raise TrailerDamaged(
            f"its checksum record has {len(tail) - record - _EOCD_SIZE} bytes, {length} were written (cut short?)"
        )
    try:
        data = json.loads(tail[at + len(TRAILER_MAGIC) :])
        return Digest.from_json(data), start + record + _EOCD_SIZE
    except (ValueError, KeyError, TypeError) as err:
        raise TrailerDamaged(f"its checksum record is unreadable ({err})") from err


# ---------------------------------------------------------------------------------------- recording while saving
def write_manifest(directory: Where, digests: dict[str, Digest]) -> None:
    """The manifest of a directory checkpoint: ``digests``, by file name in ``directory`` (its staging directory,
    before the commit makes it visible)."""
    data = {
        "format_version": MANIFEST_VERSION,
        "algorithm": ALGORITHM,
        "files": {name: digests[name].to_json() for name in sorted(digests)},
    }
    with files.open_write(directory / MANIFEST) as handle:
        handle.write(json.dumps(data, indent=1, sort_keys=True).encode())


class Recorder:
    """The digests of the files one rank writes under ``root`` during one save (thread-safe)."""

    def __init__(self, root: Where) -> None:
        self.root = root
        self.files: dict[str, Digest] = {}
        self._lock = threading.Lock()

    def add(self, file: str | os.PathLike[str] | Where, digest: Digest) -> None:
        with self._lock:  # a checkpoint folder is flat: a file is known by its name (a path's or a URL's)
            self.files[_name(file)] = digest

    def wrap(
        self,
        raw: BinaryIO,
        file: str | os.PathLike[str],
        trailer: bool = False,
        expected: int | None = None,
        entries: bool = False,
        parts: int = 0,
    ) -> HashingFile:
        """``raw``, open for writing on ``file``, hashed; its digest recorded when it is finished (``trailer``,
        ``entries``: see :class:`HashingFile`; ``parts``: see :func:`block_size`)."""
        block = block_size(expected, parts)
        return HashingFile(raw, block, trailer=trailer, on_close=lambda d: self.add(file, d), entries=entries)

    def rename(self, old: str | os.PathLike[str], new: str | os.PathLike[str]) -> None:
        """A file written under one name and renamed (a writer's ``.tmp`` file put in place)."""
        with self._lock:
            if _name(old) in self.files:
                self.files[_name(new)] = self.files.pop(_name(old))


def _name(file: Any) -> str:
    return posixpath.basename(str(file).replace(os.sep, "/").rstrip("/"))


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("checkpoint_recorder", default=None)


@contextlib.contextmanager
def recording(recorder: Recorder | None) -> Iterator[Recorder | None]:
    """Files opened with :func:`open_for_writing` in this thread (and context) are recorded by ``recorder``;
    ``None``: no checksums are computed."""
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def active() -> Recorder | None:
    return _RECORDER.get()


def wrap(raw: BinaryIO, file: Where, *, trailer: bool = False, expected: int | None = None, parts: int = 0) -> Any:
    """``raw`` (open for writing on ``file``) hashed and recorded by the active recorder; ``raw`` itself when no
    recorder is active (checksums off). ``trailer``: see :class:`HashingFile`."""
    recorder = active()
    return raw if recorder is None else recorder.wrap(raw, file, trailer, expected, parts=parts)


@contextlib.contextmanager
def open_for_writing(
    file: Where, *, trailer: bool = False, expected: int | None = None, parts: int = 0
) -> Iterator[Any]:
    """Open ``file`` for writing (:func:`.files.open_write`), hashed while written when a recorder is active (see
    :func:`wrap`)."""
    with files.open_write(file) as raw:
        handle = wrap(raw, file, trailer=trailer, expected=expected, parts=parts)
        yield handle
        if isinstance(handle, HashingFile):
            handle.finish()
