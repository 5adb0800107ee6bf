"""Full checkpoints written while their tensors arrive: rank 0 never holds the whole gathered state.

An engine builds the full state dict with a :class:`FullStream` instead of gathering it: on rank 0 each gathered
tensor is a placeholder (``torch.empty`` of its shape and dtype: address space only, never touched) and the stream
records which rank sends which piece of it under which tag; the other ranks record the pieces they will send (views of
their live shards). The checkpoint dict is then written by :meth:`FullStream.write` on rank 0, while every other rank
runs :meth:`FullStream.send` (posting its sends and waiting for them) in the same write step of the save protocol.

:meth:`FullStream.write` is ``torch.save`` itself (torch's private writer, see :mod:`..adapters.torch_internals`, with
torch.save's default pickle module and protocol and its byte-order record), given a zip writer that passes every record
through except a placeholder's storage: that one is received into one of two reused host buffers (rank 0's own pieces
are copied in) and the buffer is written in its place. While one buffer is written, the next placeholder's pieces are
received into the other. The file is a ``torch.save`` file like any other: same keys, order, dtypes, shapes and values
as the eagerly gathered state would give, loadable by ``torch.load`` (``weights_only``, ``mmap``) and Lightning.

If rank 0's write fails midway (a full disk, a read-only target, a vanished directory), it still receives every piece
it has not received yet (discarding it), so no sender waits forever; the save protocol then raises the same
``CheckpointSaveError`` on every rank. Placeholders must never reach user code: the front doors stream only when
nothing reads the checkpoint between building it and writing it (see ``strategy.py`` and ``fabric.py``), and
:func:`available` says whether this torch has the private writer with the signature it was checked with (torch 2.6,
2.9 and 2.13, where the files are byte for byte those ``torch.save`` writes to a file object); otherwise the state is
gathered eagerly, as before.

With ``async_save``, a background save stages :meth:`FullStream.pieces` (the views of live shards each rank
contributes) and runs :meth:`FullStream.with_pieces` of those copies in its thread, over its own process group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_fsdp.adapters import torch_internals
from lightning_gaudi_fsdp.checkpoint.space import ByteCounter

log = logging.getLogger(__name__)


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
        """Other ranks: send every planned piece to rank 0 and wait until each was received."""
        import torch.distributed as dist

        works = [dist.isend(piece, dst=0, tag=tag, group=self.group) for piece, tag in self._sends]
        for work in works:
            work.wait()

    def write(self, obj: Any, file: Path) -> None:
        """Rank 0: ``torch.save(obj, file)``, each placeholder's storage written from the pieces received for it.
        Every planned piece is received before this returns or raises."""
        receiver = _Receiver(self._records, self.group)
        try:
            order = torch_internals.storage_order(obj, ByteCounter())
            with open(file, "wb") as handle:
                torch_internals.save_through(obj, handle, lambda writer: _Writer(writer, receiver, order))
        finally:
            receiver.drain()
        log.debug(
            f"streamed {len(self._records)} gathered tensors into {str(file)!r} through "
            f"{receiver.buffers} receive buffers of {receiver.capacity} bytes"
        )


class _Writer:
    """torch's zip writer, except that a placeholder's storage is written from the buffer its pieces arrived in."""

    def __init__(self, writer: Any, receiver: _Receiver, order: list[int]) -> None:
        self._writer = writer
        self._receiver = receiver
        self._order = order
        self._numeric = False

    def write_record(self, name: str, data: Any, size: int) -> None:
        if name == ".format_version":
            # torch writes this record since it writes storages in the order of their keys (0, 1, 2...); before,
            # it wrote them sorted as strings (0, 1, 10, 11...). Only the prefetching depends on the guess.
            self._numeric = True
        address = data.data_ptr() if name.startswith("data/") and isinstance(data, torch.UntypedStorage) else None
        if address is None or address not in self._receiver.records or size == 0:
            self._writer.write_record(name, data, size)
            return
        if not self._receiver.expects:
            keys = range(len(self._order))
            self._receiver.expect([self._order[k] for k in (keys if self._numeric else sorted(keys, key=str))])
        buffer = self._receiver.fetch(address)
        try:
            self._writer.write_record(name, buffer.untyped_storage(), size)
        finally:
            self._receiver.release(buffer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


class _Receiver:
    """Rank 0: receives each placeholder's pieces into one of two reused byte buffers, the next expected one ahead."""

    def __init__(self, records: dict[int, _Record], group: Any = None) -> None:
        self.records = records
        self.group = group
        self.expects: list[int] = []
        self._next = 0  # expects[:_next] are all received or on their way
        self.capacity = max((r.nbytes for r in records.values()), default=0)
        self.buffers = 0
        self._free: list[torch.Tensor] = []
        self._done: set[int] = set()
        self._ahead: dict[int, tuple[torch.Tensor, list[Any]]] = {}

    def expect(self, order: list[int]) -> None:
        self.expects = [address for address in order if address in self.records]

    def fetch(self, address: int) -> torch.Tensor:
        """The byte buffer holding the tensor planned under ``address`` (give it back with :meth:`release`)."""
        entry = self._ahead.pop(address, None)
        if entry is None:
            entry = self._post(address, self._buffer())
        self._done.add(address)
        self._prefetch()
        buffer, works = entry
        for work in works:
            work.wait()
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)

    def drain(self) -> None:
        """Receive, and drop, every piece not received yet, so that no sender waits forever."""
        try:
            for address in self.records:
                if address in self._done:
                    continue
                self.release(self.fetch(address))
        except Exception as err:  # noqa: BLE001 - a lost peer; the save fails on its own error
            log.warning(f"a full checkpoint's pieces could not all be received after the write stopped: {err}")

    def _buffer(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        self.buffers += 1
        return torch.empty(self.capacity, dtype=torch.uint8)

    def _prefetch(self) -> None:
        if self._ahead or (not self._free and self.buffers >= 2):
            return
        while self._next < len(self.expects) and self.expects[self._next] in self._done:
            self._next += 1
        if self._next < len(self.expects):
            upcoming = self.expects[self._next]
            self._ahead[upcoming] = self._post(upcoming, self._buffer())

    def _post(self, address: int, buffer: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        import torch.distributed as dist

        record = self.records[address]
        flat = buffer[: record.nbytes].view(record.placeholder.dtype)
        for start, end, piece in record.own:
            flat[start:end].copy_(piece.reshape(-1))
        works = [
            dist.irecv(flat[start:end], src=src, tag=tag, group=self.group) for start, end, src, tag in record.parts
        ]
        return buffer, works
