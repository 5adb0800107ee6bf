"""Full checkpoints written while their tensors arrive: rank 0 never holds the whole gathered state.

An engine builds the full state dict with a :class:`FullStream` instead of gathering it: on rank 0 each gathered
tensor is a placeholder (``torch.empty`` of its shape and dtype: address space only, never touched) and the stream
records which rank sends which piece of it under which tag; the other ranks record the pieces they will send (views of
their live shards). The checkpoint dict is then written by :meth:`FullStream.write` on rank 0, while every other rank
runs :meth:`FullStream.send` (posting its sends and waiting for them) in the same write step of the save protocol.

:meth:`FullStream.write` is ``torch.save`` itself (torch's private writer, see :mod:`..adapters.torch_internals`, with
torch.save's default pickle module and protocol and its byte-order record), writing to a file that passes every byte
through except a placeholder's data: when torch's zip writer hands that over (without a CRC32 to compute it never reads
it), the file writes the tensor's pieces in its place, in order: rank 0's own straight from its shards; a rank that can
open the same file (same device and inode under the same running kernel: the same host; not on a FUSE mount) writes its
pieces into it itself, at the offsets rank 0 names in batches as its writer reaches them, while rank 0 writes on past
them (where the save records checksums, that rank hashes its pieces as it writes them: see :mod:`.stream_in_place`, and
its limit on the number of pieces); the pieces of any other rank come from a ring of receive memory (at most 64 MiB, or
two of the largest pieces) into which they are received ahead of the writer, in the order it will write them. Nothing is
copied on rank 0 but what the kernel copies into the page cache, as for ``torch.save``. With a CRC32 per record
(``checkpoint_crc32=True``) torch's writer reads the data it is given, so each placeholder's pieces are first received
and assembled into one reused buffer. The file is a ``torch.save`` file like any other: same keys, order, dtypes, shapes
and values as the eagerly gathered state would give, byte for byte, loadable by ``torch.load`` (``weights_only``,
``mmap``) and Lightning. Pieces that would leave part of a tensor out fail the save before anything is written.

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

This module holds the plan and the interception of torch's writer; rank 0's receiving ring and its batched requests
are in :mod:`.stream_receiver`, the same-host transport (the in-place ``pwrite``) in :mod:`.stream_in_place`, and the
``ctypes`` buffer calls in :mod:`..adapters.buffers`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_fsdp.adapters import buffers, torch_internals
from lightning_gaudi_fsdp.checkpoint import checksum, files, stream_in_place
from lightning_gaudi_fsdp.checkpoint.space import ByteCounter
from lightning_gaudi_fsdp.checkpoint.stream_receiver import Hole, Receiver, Record

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch has the private writer the stream uses, with the signature it was checked with."""
    return torch_internals.streaming_writer_available()


class FullStream:
    """The plan of one full checkpoint's gather (see the module docstring). Every rank adds the same pieces in the
    same order (:meth:`gather`); message ``i`` carries tag ``i``, so they are matched whatever order rank 0 receives
    them in."""

    def __init__(self, rank: int, group: Any = None) -> None:
        self.rank = rank
        self.group = group  # the process group the pieces travel over (None: the default group)
        self._tag = 0
        self._records: dict[int, Record] = {}  # rank 0: placeholder storage address -> record
        self._sends: list[tuple[torch.Tensor, int]] = []  # other ranks: (piece, tag)
        self.in_place = False  # whether the last save's other-rank pieces were written into the file by their ranks
        self.senders = 0  # rank 0: how many ranks sent their pieces in the last save instead (other hosts)
        self.placed: list[tuple[int, int, int]] = []  # rank 0: (rank, offset, bytes) of each piece written in place

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
        record = Record(torch.empty(shape, dtype=dtype)) if self.rank == 0 else None
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
                address: Record(
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
        that file (:meth:`Receiver.connect`), else send it to rank 0; return once each is written or received."""
        import torch.distributed as dist

        fd, block = stream_in_place.open_checkpoint(self.group)
        self.in_place = fd is not None
        if fd is None:
            stream_in_place.wait([dist.isend(piece, dst=0, tag=tag, group=self.group) for piece, tag in self._sends])
            return
        try:
            stream_in_place.serve(fd, {tag: piece for piece, tag in self._sends}, self.group, block)
        finally:
            os.close(fd)

    def write(self, obj: Any, file: Path | files.Remote, expected: int | None = None) -> None:
        """Rank 0: ``torch.save(obj, file)``, each placeholder's storage written from the pieces it is made of.
        Every planned piece is received before this returns or raises. While the save records checksums the file
        carries them (``expected``: about its size; see :mod:`.checksum`): the ranks writing in place hash their
        pieces and send the digests (see :mod:`.stream_in_place`), unless they might not fit the file's zip comment,
        when every piece goes through rank 0's file."""
        receiver = Receiver(self._records, self.group)
        # at a URL: each tensor assembled on rank 0 and written through the upload (no in-place writes, no holes)
        local = not files.is_remote(file)
        direct = not torch.serialization.get_crc32_options() and local
        parts = receiver.parts
        try:
            receiver.arrange()
            order = torch_internals.storage_order(obj, ByteCounter())
            with checksum.open_for_writing(file, trailer=True, expected=expected, parts=parts) as handle:
                hashed = isinstance(handle, checksum.HashingFile)
                shared = direct and (not hashed or checksum.trailer_fits(expected, parts))
                receiver.connect(handle if shared else None, Path(file) if local else None)
                self.in_place = bool(receiver.writers)
                self.senders = len(receiver.sources) - len(receiver.writers)
                sink = _File(handle, receiver) if direct else handle
                torch_internals.save_through(obj, sink, lambda writer: _Writer(writer, receiver, order, sink))
                receiver.finish()
                for tag, digests in receiver.digests.items():
                    handle.fill(tag, digests)
                self.placed = list(receiver.placed)
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

    def __init__(self, writer: Any, receiver: Receiver, order: list[int], sink: Any) -> None:
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

    def __init__(self, handle: Any, receiver: Receiver) -> None:
        self._handle = handle
        self._receiver = receiver
        self.pending: Record | None = None

    def write(self, data: Any) -> int:
        record = self.pending
        if record is not None and len(data) == record.nbytes and buffers.address(data) == record.address:
            self.pending = None
            for chunk in self._receiver.chunks(record):
                if isinstance(chunk, Hole) and isinstance(self._handle, checksum.HashingFile):
                    self._receiver.place(chunk.tag, self._handle.skip(chunk.size, chunk.tag))  # hashed by its rank
                elif isinstance(chunk, Hole):  # its rank writes it there itself
                    offset = self._handle.tell()
                    self._handle.seek(chunk.size, os.SEEK_CUR)  # what comes before is written (flushed) first
                    self._receiver.place(chunk.tag, offset)
                else:
                    self._handle.write(buffers.raw(chunk))
            return len(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()
