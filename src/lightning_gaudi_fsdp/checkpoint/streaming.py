"""Full checkpoints written while their tensors arrive: rank 0 never holds the whole gathered state.

An engine builds the full state dict with a :class:`FullStream` instead of gathering it: on rank 0 each gathered
tensor is a placeholder (``torch.empty`` of its shape and dtype: address space only, never touched) and the stream
records which rank sends which piece of it under which tag; the other ranks record the pieces they will send (views of
their live shards). The checkpoint dict is then written by :meth:`FullStream.write` on rank 0, while every other rank
runs :meth:`FullStream.send` (posting its sends and waiting for them) in the same write step of the save protocol.

:meth:`FullStream.write` is ``torch.save`` itself (torch's private writer, see :mod:`..adapters.torch_internals`, with
torch.save's default pickle module and protocol and its byte-order record), writing to a file that passes every byte
through except a placeholder's data: when torch's zip writer hands that over (without a CRC32 to compute it never
reads it), the file writes the tensor's pieces in its place, in order: rank 0's own straight from its shards; a rank
that can open the same file (same device and inode under the same running kernel: the same host; not on a FUSE mount)
writes its pieces into it itself, at the offsets rank 0 names in batches as its writer reaches them, while rank 0
writes on past them; the pieces of any other rank come from a ring of receive memory (at most 64 MiB, or two of the
largest pieces) into which they are received ahead of the writer, in the order it will write them. Nothing is copied
on rank 0 but what the kernel copies into the page cache, as for ``torch.save``. With a CRC32 per record
(``checkpoint_crc32=True``) torch's writer reads the data it is given, so each placeholder's pieces are first received
and assembled into one reused buffer. The file is a ``torch.save`` file like any other: same keys, order, dtypes,
shapes and values as the eagerly gathered state would give, byte for byte, loadable by ``torch.load``
(``weights_only``, ``mmap``) and Lightning. Pieces that would leave part of a tensor out fail the save before anything
is written.

If rank 0's write fails midway (a full disk, a read-only target, a vanished directory), it still receives every piece
it has not received yet (discarding it) and tells the ranks writing in place to skip the rest, so no sender waits
forever; a rank that cannot write its pieces in place says so in its answer, and the save fails; the save protocol
then raises the same ``CheckpointSaveError`` on every rank. Placeholders must never reach user code: the front doors
stream only when nothing reads the checkpoint between building it and writing it (see ``strategy.py`` and
``fabric.py``), and :func:`available` says whether this torch has the private writer with the signature it was checked
with (torch 2.6, 2.9 and 2.13, where the files are byte for byte those ``torch.save`` writes to a file object);
otherwise the state is gathered eagerly, as before.

With ``async_save``, a background save stages :meth:`FullStream.pieces` (the views of live shards each rank
contributes) and runs :meth:`FullStream.with_pieces` of those copies in its thread, over its own process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.checkpoint import space
from lightning_gaudi_fsdp.checkpoint.space import ByteCounter

log = logging.getLogger(__name__)

_AHEAD_BYTES = 64 << 20  # what rank 0 receives ahead of its writes, at most (or two of the largest pieces)
_ALIGNMENT = 64  # of each piece in the ring: any dtype's view of it is aligned
_IN_PLACE = True  # whether ranks on rank 0's host write their pieces into the checkpoint file themselves
_CONTROL_TAG = 0  # rank 0's handshake and requests (pieces are tagged 1, 2, ...)
_REQUESTS = 16  # rank 0's requests to a rank writing in place go in batches of at most this many pieces,
_REQUEST_BYTES = 16 << 20  # or of this many bytes (each message costs both ranks a fraction of a millisecond)


def available() -> bool:
    """Whether this torch has the private writer the stream uses, with the signature it was checked with."""
    return torch_internals.streaming_writer_available()


@dataclass
class _Record:
    """Rank 0: one gathered tensor, its placeholder, and where its elements come from."""

    placeholder: torch.Tensor
    parts: list[tuple[int, int, int, int]] = field(default_factory=list)  # (start, end, source rank, tag)
    own: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # rank 0's own pieces: (start, end, piece)

    @property
    def nbytes(self) -> int:
        return self.placeholder.untyped_storage().nbytes()

    @property
    def address(self) -> int:
        return self.placeholder.untyped_storage().data_ptr()


class FullStream:
    """The plan of one full checkpoint's gather (see the module docstring). Every rank adds the same pieces in the
    same order (:meth:`gather`); message ``i`` carries tag ``i``, so they are matched whatever order rank 0 receives
    them in."""

    def __init__(self, rank: int, group: Any = None) -> None:
        self.rank = rank
        self.group = group  # the process group the pieces travel over (None: the default group)
        self._tag = 0
        self._records: dict[int, _Record] = {}  # rank 0: placeholder storage address -> record
        self._sends: list[tuple[torch.Tensor, int]] = []  # other ranks: (piece, tag)
        self.in_place = False  # whether the last save's other-rank pieces were written into the file by their ranks
        self.senders = 0  # rank 0: how many ranks sent their pieces in the last save instead (other hosts)

    @property
    def pending(self) -> bool:
        """Whether any tensor of the checkpoint is to be received (rank 0) or sent (other ranks)."""
        return bool(self._records or self._sends)

    def gather(
        self, shape: tuple[int, ...], spans: Any, piece: torch.Tensor | None, senders: Any, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Plan the gather of one tensor of ``shape`` and ``dtype``: rank ``r`` in ``senders`` holds its elements
        ``spans[r] = (start, end)`` of the flattened tensor (``piece``, on that rank). Returns the placeholder on rank
        0, ``None`` elsewhere; nothing is sent or received yet."""
        record = _Record(torch.empty(shape, dtype=dtype)) if self.rank == 0 else None
        for r in senders:
            start, end = spans[r]
            self._tag += 1
            if end <= start:
                continue
            if record is not None and r == 0:
                record.own.append((start, end, piece))
            elif record is not None:
                record.parts.append((start, end, r, self._tag))
            elif r == self.rank:
                self._sends.append((piece.contiguous(), self._tag))
        if record is None:
            return None
        if record.nbytes:
            self._records[record.placeholder.untyped_storage().data_ptr()] = record
        return record.placeholder

    def pieces(self) -> list[torch.Tensor]:
        """What this rank contributes, in plan order: the pieces it sends (rank 0: copies into the buffers). These
        are views of live shards: a background save stages them and writes with :meth:`with_pieces`."""
        if self.rank == 0:
            return [piece for record in self._records.values() for _, _, piece in record.own]
        return [piece for piece, _ in self._sends]

    def with_pieces(self, pieces: list[torch.Tensor], group: Any) -> FullStream:
        """This plan with :meth:`pieces` replaced by ``pieces`` (staged copies, in the same order), its messages sent
        over ``group``; the placeholders stay the same, so it writes the same checkpoint dict."""
        twin = FullStream(self.rank, group)
        twin._tag = self._tag
        replacement = iter(pieces)
        if self.rank == 0:
            twin._records = {
                address: _Record(
                    record.placeholder, list(record.parts), [(a, b, next(replacement)) for a, b, _ in record.own]
                )
                for address, record in self._records.items()
            }
        else:
            twin._sends = [(next(replacement), tag) for _, tag in self._sends]
        return twin

    def is_placeholder(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of this plan's placeholders (rank 0), which only :meth:`write` fills."""
        return self.rank == 0 and tensor.untyped_storage().data_ptr() in self._records

    def send(self) -> None:
        """Other ranks: write every planned piece into the checkpoint file where rank 0 asks, if this rank can open
        that file (:meth:`_Receiver.connect`), else send it to rank 0; return once each is written or received."""
        import torch.distributed as dist

        fd = _open_checkpoint(self.group)
        self.in_place = fd is not None
        if fd is None:
            _wait([dist.isend(piece, dst=0, tag=tag, group=self.group) for piece, tag in self._sends])
            return
        try:
            _serve(fd, {tag: piece for piece, tag in self._sends}, self.group)
        finally:
            os.close(fd)

    def write(self, obj: Any, file: Path) -> None:
        """Rank 0: ``torch.save(obj, file)``, each placeholder's storage written from the pieces it is made of.
        Every planned piece is received before this returns or raises."""
        receiver = _Receiver(self._records, self.group)
        direct = not torch.serialization.get_crc32_options()
        try:
            receiver.arrange()
            order = torch_internals.storage_order(obj, ByteCounter())
            with open(file, "wb") as handle:
                receiver.connect(handle if direct else None, Path(file))
                self.in_place = bool(receiver.writers)
                self.senders = len(receiver.sources) - len(receiver.writers)
                sink = _File(handle, receiver) if direct else handle
                torch_internals.save_through(obj, sink, lambda writer: _Writer(writer, receiver, order, sink))
                receiver.finish()
        finally:
            receiver.drain()
        log.debug(
            f"streamed {len(self._records)} gathered tensors into {str(file)!r}: {len(receiver.writers)} rank(s) "
            f"wrote their pieces in place, {self.senders} sent them"
            + (f", received ahead into {receiver.capacity} bytes" if self.senders else "")
            + ("" if direct else ", each tensor assembled")
        )


class _Writer:
    """torch's zip writer, except that a placeholder's storage is written from the pieces it is made of: straight
    from them by the :class:`_File` it writes to (``direct``), else assembled first (a CRC32 is computed of the
    data torch's writer is given)."""

    def __init__(self, writer: Any, receiver: _Receiver, order: list[int], sink: Any) -> None:
        self._writer = writer
        self._receiver = receiver
        self._order = order
        self._file = sink if isinstance(sink, _File) else None
        self._numeric = False

    def write_record(self, name: str, data: Any, size: int) -> None:
        if name == ".format_version":
            # torch writes this record since it writes storages in the order of their keys (0, 1, 2...); before,
            # it wrote them sorted as strings (0, 1, 10, 11...). Only receiving ahead depends on the guess.
            self._numeric = True
        address = data.data_ptr() if name.startswith("data/") and isinstance(data, torch.UntypedStorage) else None
        record = self._receiver.records.get(address) if address is not None and size else None
        if record is None:
            self._writer.write_record(name, data, size)
            return
        if not self._receiver.expecting:
            keys = range(len(self._order))
            self._receiver.expect([self._order[k] for k in (keys if self._numeric else sorted(keys, key=str))])
        if self._file is None:
            self._writer.write_record(name, self._receiver.assemble(record).untyped_storage(), size)
            return
        self._file.pending = record
        self._writer.write_record(name, data, size)  # the file writes the pieces where torch's writer hands over data
        if self._file.pending is not None:
            raise RuntimeError(f"torch's zip writer did not hand over record {name!r} ({size} bytes) in one write")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


class _File:
    """The checkpoint file as torch's zip writer sees it: when the writer hands over the data of the pending
    placeholder (its address, all its bytes: one write, as torch's writer makes it when it computes no CRC32), the
    pieces are written in its place, rank 0's own straight from its shards, the others' as they arrive."""

    def __init__(self, handle: Any, receiver: _Receiver) -> None:
        self._handle = handle
        self._receiver = receiver
        self.pending: _Record | None = None

    def write(self, data: Any) -> int:
        record = self.pending
        if record is not None and len(data) == record.nbytes and _address(data) == record.address:
            self.pending = None
            for chunk in self._receiver.chunks(record):
                if isinstance(chunk, _Hole):  # its rank writes it there itself
                    offset = self._handle.tell()
                    self._handle.seek(chunk.size, os.SEEK_CUR)  # what comes before is written (flushed) first
                    self._receiver.place(chunk.tag, offset)
                else:
                    self._handle.write(_raw(chunk))
            return len(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


def _address(data: Any) -> int:
    """Where the bytes of a buffer start (a read-only one too, as torch's writer hands over: ``torch.frombuffer``
    would warn about it, and silencing that is not thread-safe while a background save writes)."""
    view = _PyBuffer()
    if _get_buffer(data, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise TypeError(f"a {type(data).__name__} has no buffer to write")
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (its layout is part of the stable ABI)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)(
    ("PyObject_GetBuffer", ctypes.pythonapi)
)
_release_buffer = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_PyBuffer))(("PyBuffer_Release", ctypes.pythonapi))


def _raw(chunk: torch.Tensor) -> Any:
    """The bytes of a contiguous uint8 tensor as a buffer a file writes without copying them first."""
    return (ctypes.c_ubyte * chunk.numel()).from_address(chunk.data_ptr())


def _bytes(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``piece``'s elements in ``dtype``, flat and contiguous, viewed as bytes (a copy only if they are not)."""
    flat = piece.reshape(-1)
    if flat.dtype != dtype:
        flat = flat.to(dtype)
    return flat.contiguous().view(torch.uint8)


class _Receiver:
    """Rank 0: takes the other ranks' pieces. A rank that can open the checkpoint file rank 0 writes (on the same
    host: :meth:`connect`) writes each piece into it itself, where rank 0 asks when its writer reaches the piece
    (:meth:`place`), while rank 0 writes on past it; nothing but the requests and answers travel. The others' pieces
    are received into one reused ring of bytes, as many ahead of the writer, in the order it will write them, as the
    ring holds; a piece is given back once written (first in, first out)."""

    def __init__(self, records: dict[int, _Record], group: Any = None) -> None:
        self.records = records
        self.group = group
        self.expecting = False
        self._parts = {
            tag: (record, start, end, src) for record in records.values() for start, end, src, tag in record.parts
        }
        sizes = [self._size(tag) for tag in self._parts]
        largest = _aligned(max(sizes, default=0))
        self.capacity = max(2 * largest, min(_AHEAD_BYTES, _aligned(sum(sizes) // 8))) if sizes else 0
        self._ring: torch.Tensor | None = None
        self._slots: deque[list[int]] = deque()  # [offset, size, given back] of what the ring holds, oldest first
        self._plan: deque[int] = deque()  # tags still to receive ahead, in writing order
        self._posted: dict[int, tuple[torch.Tensor, Any, list[int] | None]] = {}  # tag -> (bytes, work|None, slot)
        self._started: set[int] = set()  # tags received or on their way
        self._assembly: torch.Tensor | None = None
        self._segments: dict[int, list[tuple[int, int, torch.Tensor | None, int]]] = {}  # see arrange
        self.sources = sorted({src for _, _, _, src in self._parts.values()})
        self.writers: set[int] = set()  # sources that write their pieces into the file (see connect)
        self._requests: list[Any] = []  # the works of the requests sent to the writers (see place)
        self._batches: dict[int, list[tuple[int, int, int]]] = {}  # writer -> requests not sent: (tag, offset, size)
        self._connected = self._answered = False

    def connect(self, handle: Any = None, file: Path | None = None) -> None:
        """Agree with every source how its pieces come: rank 0 names the file it writes (``handle``: open on
        ``file``; None: do not write in place) by path, device, inode and the kernel's boot id; a source that opens
        that path and finds the same file under the same kernel answers 1 and writes its pieces there itself, any
        other answers 0 and sends them (another host, another mount namespace)."""
        import torch.distributed as dist

        if not self.sources or self._connected:
            return
        shareable = handle is not None and file is not None and _IN_PLACE and _shares_writes(os.path.realpath(file))
        stat = os.fstat(handle.fileno()) if shareable else None
        boot, device = space.file_system_id(stat) if stat else (0, 0)
        path = os.fsencode(os.path.abspath(file)) if boot else b""  # any name the OS takes (undecodable bytes too)
        hello = torch.tensor([boot, device, stat.st_ino if boot else 0, len(path)], dtype=torch.int64)
        # only now: if anything above raised, drain() connects again without a file, and the sources send their pieces
        self._connected = True
        answers = {src: torch.zeros(1, dtype=torch.int64) for src in self.sources}
        works = [dist.isend(hello, dst=src, tag=_CONTROL_TAG, group=self.group) for src in self.sources]
        if path:
            name = torch.frombuffer(bytearray(path), dtype=torch.uint8)
            works += [dist.isend(name, dst=src, tag=_CONTROL_TAG, group=self.group) for src in self.sources]
        works += [dist.irecv(answers[src], src=src, tag=_CONTROL_TAG, group=self.group) for src in self.sources]
        _wait(works)
        self.writers = {src for src, answer in answers.items() if int(answer) == 1}

    def place(self, tag: int, offset: int) -> None:
        """Ask piece ``tag``'s rank to write it into the file at byte ``offset`` (offset -1: to skip it), in a batch
        sent once it holds :data:`_REQUESTS` pieces or :data:`_REQUEST_BYTES` bytes (or by :meth:`finish`)."""
        src = self._parts[tag][3]
        batch = self._batches.setdefault(src, [])
        batch.append((tag, offset, self._size(tag)))
        self._started.add(tag)
        if len(batch) == _REQUESTS or sum(size for _, o, size in batch if o >= 0) >= _REQUEST_BYTES:
            self._send_batch(src)

    def _send_batch(self, src: int) -> None:
        """Send writer ``src`` its requests not sent yet: ``[_REQUESTS, 3]`` of (tag, offset, bytes), tag 0: none."""
        import torch.distributed as dist

        batch = self._batches.pop(src, [])
        if batch:
            requests = torch.zeros(_REQUESTS, 3, dtype=torch.int64)
            requests[: len(batch)] = torch.tensor(batch, dtype=torch.int64)
            self._requests.append(dist.isend(requests, dst=src, tag=_CONTROL_TAG, group=self.group))

    def finish(self) -> None:
        """Tell each writer to skip the pieces not asked for (the checkpoint written holds no placeholder of theirs,
        or the write stopped), then wait until it wrote every piece asked for (its one answer, once it handled a
        request for each: the count of pieces it could not write); raise if one could not write them all."""
        import torch.distributed as dist

        if self._answered or not self.writers:
            return
        self._answered = True
        for tag in [tag for tag, part in self._parts.items() if part[3] in self.writers and tag not in self._started]:
            self.place(tag, -1)
        for src in list(self._batches):
            self._send_batch(src)
        _wait(self._requests)
        self._requests = []
        answers = {src: torch.zeros(1, dtype=torch.int64) for src in sorted(self.writers)}
        _wait([dist.irecv(answer, src=src, tag=_CONTROL_TAG, group=self.group) for src, answer in answers.items()])
        failed = [src for src, answer in answers.items() if int(answer) != 0]
        if failed:
            raise RuntimeError(
                f"rank(s) {failed} could not write their pieces of the full checkpoint into the file (see their errors)"
            )

    def expect(self, order: list[int]) -> None:
        """The placeholders' addresses in the order the writer will meet them: their pieces are received ahead."""
        self.expecting = True
        ordered = [self.records[address] for address in order if address in self.records]
        self._plan = deque(
            tag for record in ordered for _, _, src, tag in sorted(record.parts) if src not in self.writers
        )
        self._pump()

    def arrange(self) -> None:
        """Order each placeholder's pieces; a placeholder they do not cover raises before anything is written."""
        for address, record in self.records.items():
            own = [(start, end, piece, 0) for start, end, piece in record.own]
            segments = sorted(own + [(start, end, None, tag) for start, end, _, tag in record.parts], key=_start)
            position, numel = 0, record.placeholder.numel()
            for start, end, _, _ in [*segments, (numel, numel, None, 0)]:
                if start != position:
                    raise RuntimeError(
                        f"the pieces of a gathered tensor of shape {tuple(record.placeholder.shape)} leave elements "
                        f"[{position}, {start}) out"
                    )
                position = end
            self._segments[address] = segments

    def chunks(self, record: _Record) -> Iterator[torch.Tensor | _Hole]:
        """``record``'s bytes, piece by piece in order: each a contiguous uint8 tensor (valid until the next), or a
        :class:`_Hole` where the piece's rank writes it into the file itself."""
        for _, _, piece, tag in self._segments[record.address]:
            if piece is not None:
                yield _bytes(piece, record.placeholder.dtype)
                continue
            if self._parts[tag][3] in self.writers:
                yield _Hole(tag, self._size(tag))
                continue
            yield self._take(tag)
            self._give_back(tag)

    def assemble(self, record: _Record) -> torch.Tensor:
        """``record``'s bytes in one reused buffer (for a writer that reads them all at once)."""
        if self._assembly is None:
            self._assembly = torch.empty(max(r.nbytes for r in self.records.values()), dtype=torch.uint8)
        offset = 0
        for chunk in self.chunks(record):
            self._assembly[offset : offset + chunk.numel()].copy_(chunk)
            offset += chunk.numel()
        return self._assembly[:offset]

    def drain(self) -> None:
        """Receive, and drop, every piece not received yet, and tell the ranks writing in place to skip the pieces
        not asked for, so that no sender waits forever."""
        try:
            self.connect()  # the write stopped before it agreed how the pieces come: they are sent
            for tag in list(self._posted):
                work = self._posted.pop(tag)[1]
                if work is not None:  # a piece taken when the write stopped was waited for already
                    work.wait()
            with contextlib.suppress(RuntimeError):  # the save fails on the error that stopped the write
                self.finish()  # the writers' answers, if not taken yet
            missing = [tag for tag in self._parts if tag not in self._started]
            scratch = torch.empty(max(map(self._size, missing), default=0), dtype=torch.uint8)
            for tag in missing:
                self._post(tag, scratch[: self._size(tag)], None)
                self._posted.pop(tag)[1].wait()
        except Exception as err:  # noqa: BLE001 - a lost peer; the save fails on its own error
            log.warning(f"a full checkpoint's pieces could not all be received after the write stopped: {err}")

    def _size(self, tag: int) -> int:
        record, start, end, _ = self._parts[tag]
        return (end - start) * record.placeholder.element_size()

    def _take(self, tag: int) -> torch.Tensor:
        """The bytes of piece ``tag``, received (ahead into the ring, else now into memory of their own)."""
        if tag not in self._posted:
            self._pump()
        if tag not in self._posted:  # met out of the expected order
            self._post(tag, torch.empty(self._size(tag), dtype=torch.uint8), None)
        data, work, slot = self._posted[tag]
        work.wait()
        self._posted[tag] = (data, None, slot)  # a gloo work waited twice waits for a second message, forever
        return data

    def _give_back(self, tag: int) -> None:
        slot = self._posted.pop(tag)[2]
        if slot is not None:
            slot[2] = True
            while self._slots and self._slots[0][2]:
                self._slots.popleft()
        self._pump()

    def _pump(self) -> None:
        """Post the receives of the next planned pieces while the ring has room for them."""
        while self._plan:
            tag = self._plan[0]
            if tag in self._started:
                self._plan.popleft()
                continue
            size = self._size(tag)
            offset = self._room(_aligned(size))
            if offset is None:
                return
            if self._ring is None:
                self._ring = torch.empty(self.capacity, dtype=torch.uint8)
            slot = [offset, _aligned(size), False]
            self._slots.append(slot)
            self._post(tag, self._ring[offset : offset + size], slot)
            self._plan.popleft()

    def _room(self, size: int) -> int | None:
        """Where in the ring ``size`` bytes fit after the newest slot, without reaching the oldest; None: nowhere."""
        if not self._slots:
            return 0 if size <= self.capacity else None
        first, (last, last_size, _) = self._slots[0][0], self._slots[-1]
        end = last + last_size
        if last >= first:  # in use: [first, end)
            if end + size <= self.capacity:
                return end
            return 0 if size <= first else None
        return end if end + size <= first else None  # in use: [first, capacity) and [0, end)

    def _post(self, tag: int, data: torch.Tensor, slot: list[int] | None) -> None:
        import torch.distributed as dist

        record, _, _, src = self._parts[tag]
        work = dist.irecv(data.view(record.placeholder.dtype), src=src, tag=tag, group=self.group)
        self._started.add(tag)
        self._posted[tag] = (data, work, slot)


class _Hole(NamedTuple):
    """Where piece ``tag`` (``size`` bytes) goes in the file: its rank writes it there itself."""

    tag: int
    size: int


def _shares_writes(path: str) -> bool:
    """Whether processes writing ``path`` through different descriptors write one file, as on every kernel file
    system (ext4, xfs, tmpfs, overlay, NFS...): not on a FUSE mount, where each open file may be uploaded whole when
    it is closed (object-store mounts), nor where the file system is unknown (:func:`.space.mount_of`)."""
    kind = space.mount_of(path)[1]
    return bool(kind) and not kind.startswith("fuse")


def _open_checkpoint(group: Any) -> int | None:
    """A source's side of :meth:`_Receiver.connect`: the file rank 0 writes, open for writing, if this rank finds
    it (the same file under the same kernel); else None, and the pieces are sent."""
    import torch.distributed as dist

    hello = torch.zeros(4, dtype=torch.int64)  # boot id, device, inode, length of the path (0: send the pieces)
    dist.recv(hello, src=0, tag=_CONTROL_TAG, group=group)
    boot, device, inode, length = hello.tolist()
    fd = None
    if length:
        name = torch.empty(length, dtype=torch.uint8)
        dist.recv(name, src=0, tag=_CONTROL_TAG, group=group)
        try:
            fd = os.open(bytes(name.tolist()), os.O_WRONLY)
            stat = os.fstat(fd)
            if (boot, device, inode) != (*space.file_system_id(stat), stat.st_ino):
                os.close(fd)
                fd = None
        except OSError as err:  # not there from here: rank 0 receives the pieces
            log.debug(f"the full checkpoint being written could not be opened on this rank ({err})")
    dist.send(torch.tensor([int(fd is not None)], dtype=torch.int64), dst=0, tag=_CONTROL_TAG, group=group)
    return fd


def _serve(fd: int, pieces: dict[int, torch.Tensor], group: Any) -> None:
    """A source writing in place: write each piece where rank 0 asks (``[tag, offset, bytes]``; offset -1: skip it, the
    write stopped), then answer once: how many it could not write. After a piece that cannot be written the rest are
    not written either; the first error is raised after the answer. Once a batch is written the kernel is asked to
    start writing it to disk (:func:`_start_writeback`): this rank waits for rank 0 most of the time anyway, and rank
    0's fsync at the end then has little more than rank 0's own bytes left to wait for."""
    import torch.distributed as dist

    requests, handled, failed, error = torch.zeros(_REQUESTS, 3, dtype=torch.int64), 0, 0, None
    while handled < len(pieces):
        dist.recv(requests, src=0, tag=_CONTROL_TAG, group=group)  # a batch (see _Receiver.place)
        written = []
        for tag, offset, size in requests.tolist():
            if tag == 0:
                break
            handled += 1
            if offset < 0:
                continue
            if error is not None:
                failed += 1
                continue
            data = pieces[tag].reshape(-1).view(torch.uint8)
            try:
                if data.numel() != size:  # never written past its place, whatever the plans say
                    raise OSError(f"piece {tag} holds {data.numel()} bytes, its place in the file {size}")
                _write_at(fd, data, offset)
                written.append((offset, size))
            except OSError as err:
                error, failed = err, 1
        for offset, size in written:
            _start_writeback(fd, offset, size)
    dist.send(torch.tensor([failed], dtype=torch.int64), dst=0, tag=_CONTROL_TAG, group=group)
    if error is not None:
        raise error


def _start_writeback(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to start writing bytes ``[offset, offset + size)`` of ``fd`` to disk without waiting for them
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing). Durability still comes from the fsync of
    the save protocol."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, size, 2)  # SYNC_FILE_RANGE_WRITE; advisory: an error only means no head start


@functools.cache
def _sync_file_range() -> Any:
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def _write_at(fd: int, data: torch.Tensor, offset: int) -> None:
    view, done = memoryview(_raw(data)).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _start(segment: tuple[Any, ...]) -> int:
    return segment[0]


def _aligned(size: int) -> int:
    return -(-size // _ALIGNMENT) * _ALIGNMENT
