"""Rank 0's side of a streamed full save (:mod:`.streaming`): the pieces of the other ranks. Those of a rank on the
same host are written into the file by that rank (:mod:`.stream_in_place`): rank 0 sends it batches of requests, each
naming where a piece goes, as its writer reaches them. Those of any other rank are received into a ring of receive
memory (at most 64 MiB, or two of the largest pieces) ahead of the writer, in the order it will write them.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_gaudi_fsdp.checkpoint import checksum, stream_in_place
from lightning_gaudi_fsdp.checkpoint.stream_in_place import CONTROL_TAG, REQUESTS, wait

log = logging.getLogger(__name__)

_AHEAD_BYTES = 64 << 20  # what rank 0 receives ahead of its writes, at most (or two of the largest pieces)
_ALIGNMENT = 64  # of each piece in the ring: any dtype's view of it is aligned
_REQUEST_BYTES = 16 << 20  # a batch of requests is sent at REQUESTS pieces or this many bytes (each message costs
# both ranks a fraction of a millisecond)


@dataclass
class Record:
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


class Receiver:
    """Rank 0: takes the other ranks' pieces. A rank that can open the checkpoint file rank 0 writes (on the same
    host: :meth:`connect`) writes each piece into it itself, where rank 0 asks when its writer reaches the piece
    (:meth:`place`), while rank 0 writes on past it; nothing but the requests and answers travel. The others' pieces
    are received into one reused ring of bytes, as many ahead of the writer, in the order it will write them, as the
    ring holds; a piece is given back once written (first in, first out)."""

    def __init__(self, records: dict[int, Record], group: Any = None) -> None:
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
        self.placed: list[tuple[int, int, int]] = []  # (rank, offset, bytes) of each piece asked to be written
        self.digests: dict[int, bytes] = {}  # tag -> block digests of a piece hashed by the rank that wrote it
        self._block = 0  # the block the writers hash in (0: no checksums)
        self._asked: list[int] = []  # the pieces asked to be written, in order

    @property
    def parts(self) -> int:
        """How many pieces come from the other ranks."""
        return len(self._parts)

    def connect(self, handle: Any = None, file: Path | None = None) -> None:
        """Agree with every source how its pieces come: rank 0 names the file it writes (``handle``: open on
        ``file``; None: do not write in place) by path, device, inode and the kernel's boot id; a source that opens
        that path and finds the same file under the same kernel answers 1 and writes its pieces there itself, any
        other answers 0 and sends them (another host, another mount namespace)."""
        import torch.distributed as dist

        if not self.sources or self._connected:
            return
        hello, path = stream_in_place.hello(handle, file)
        self._block = int(hello[4])
        # only now: if anything above raised, drain() connects again without a file, and the sources send their pieces
        self._connected = True
        answers = {src: torch.zeros(1, dtype=torch.int64) for src in self.sources}
        works = [dist.isend(hello, dst=src, tag=CONTROL_TAG, group=self.group) for src in self.sources]
        if path:
            name = torch.frombuffer(bytearray(path), dtype=torch.uint8)
            works += [dist.isend(name, dst=src, tag=CONTROL_TAG, group=self.group) for src in self.sources]
        works += [dist.irecv(answers[src], src=src, tag=CONTROL_TAG, group=self.group) for src in self.sources]
        wait(works)
        self.writers = {src for src, answer in answers.items() if int(answer) == 1}

    def place(self, tag: int, offset: int) -> None:
        """Ask piece ``tag``'s rank to write it into the file at byte ``offset`` (offset -1: to skip it), in a batch
        sent once it holds :data:`.stream_in_place.REQUESTS` pieces or :data:`_REQUEST_BYTES` bytes (or by
        :meth:`finish`)."""
        src = self._parts[tag][3]
        batch = self._batches.setdefault(src, [])
        batch.append((tag, offset, self._size(tag)))
        self._started.add(tag)
        if offset >= 0:
            self.placed.append((src, offset, self._size(tag)))
            self._asked.append(tag)
        if len(batch) == REQUESTS or sum(size for _, o, size in batch if o >= 0) >= _REQUEST_BYTES:
            self._send_batch(src)

    def _send_batch(self, src: int) -> None:
        """Send writer ``src`` its requests not sent yet: ``[REQUESTS, 3]`` of (tag, offset, bytes), tag 0: none."""
        import torch.distributed as dist

        batch = self._batches.pop(src, [])
        if batch:
            requests = torch.zeros(REQUESTS, 3, dtype=torch.int64)
            requests[: len(batch)] = torch.tensor(batch, dtype=torch.int64)
            self._requests.append(dist.isend(requests, dst=src, tag=CONTROL_TAG, group=self.group))

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
        wait(self._requests)
        self._requests = []
        answers = {src: torch.zeros(2, dtype=torch.int64) for src in sorted(self.writers)}
        wait([dist.irecv(answer, src=src, tag=CONTROL_TAG, group=self.group) for src, answer in answers.items()])
        hashed = {src: torch.empty(int(answer[1]), dtype=torch.uint8) for src, answer in answers.items() if answer[1]}
        wait([dist.irecv(data, src=src, tag=CONTROL_TAG, group=self.group) for src, data in hashed.items()])
        failed = [src for src, answer in answers.items() if int(answer[0]) != 0]
        if not failed and self._block:
            self._take_digests({src: data.numpy().tobytes() for src, data in hashed.items()})
        if failed:
            raise RuntimeError(
                f"rank(s) {failed} could not write their pieces of the full checkpoint into the file (see their errors)"
            )

    def _take_digests(self, hashed: dict[int, bytes]) -> None:
        """Each writer's digests (``hashed``: all of them, in the order its pieces were asked for), by piece."""
        at = dict.fromkeys(hashed, 0)
        for tag in self._asked:
            src, count = self._parts[tag][3], -(-self._size(tag) // self._block) * checksum.DIGEST_BYTES
            self.digests[tag] = hashed.get(src, b"")[at.get(src, 0) : at.get(src, 0) + count]
            at[src] = at.get(src, 0) + count

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

    def chunks(self, record: Record) -> Iterator[torch.Tensor | Hole]:
        """``record``'s bytes, piece by piece in order: each a contiguous uint8 tensor (valid until the next), or a
        :class:`Hole` where the piece's rank writes it into the file itself."""
        for _, _, piece, tag in self._segments[record.address]:
            if piece is not None:
                yield piece_bytes(piece, record.placeholder.dtype)
                continue
            if self._parts[tag][3] in self.writers:
                yield Hole(tag, self._size(tag))
                continue
            yield self._take(tag)
            self._give_back(tag)

    def assemble(self, record: Record) -> torch.Tensor:
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


class Hole(NamedTuple):
    """Where piece ``tag`` (``size`` bytes) goes in the file: its rank writes it there itself."""

    tag: int
    size: int


def piece_bytes(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``piece``'s elements in ``dtype``, flat and contiguous, viewed as bytes (a copy only if they are not)."""
    flat = piece.reshape(-1)
    if flat.dtype != dtype:
        flat = flat.to(dtype)
    return flat.contiguous().view(torch.uint8)


def _start(segment: tuple[Any, ...]) -> int:
    return segment[0]


def _aligned(size: int) -> int:
    return -(-size // _ALIGNMENT) * _ALIGNMENT
