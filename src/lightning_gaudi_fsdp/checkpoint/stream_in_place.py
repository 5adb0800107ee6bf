"""The same-host transport of a streamed full save (:mod:`.streaming`): a rank that can open the checkpoint file rank 0
writes (the same device and inode under the same running kernel; not on a FUSE mount) writes its pieces into it
itself, with ``pwrite``, at the offsets rank 0 names in batches as its writer reaches them (see
:meth:`.stream_receiver.Receiver.place`), then answers once: how many pieces it could not write.

Where the save records checksums (``verify_checkpoints``), the writing rank hashes each piece as it writes it and
sends the digests with its answer; rank 0's file leaves each such piece out of its own hashing as blocks of their own
(:meth:`.checksum.HashingFile.skip`) and puts the digests in their place, so the file's checksums are those
:func:`.integrity.verify` recomputes. Each piece written in place adds up to two blocks and two block ends to the
digests the file carries in its zip comment, which holds 64 KiB: where they might not fit
(:func:`.checksum.trailer_fits`: some thousand pieces at most), the pieces are sent to rank 0 instead, which hashes
them as it writes them.

Rank 0 names its file (:func:`hello`) by path, device, inode and the kernel's boot id (:func:`.space.file_system_id`);
whether the file system shares writes between descriptors comes from the one mount table reader,
:func:`.space.mount_of`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_fsdp.adapters import buffers
from lightning_gaudi_fsdp.checkpoint import checksum, space

log = logging.getLogger(__name__)

_IN_PLACE = True  # whether ranks on rank 0's host write their pieces into the checkpoint file themselves
CONTROL_TAG = 0  # rank 0's handshake and requests (pieces are tagged 1, 2, ...)
REQUESTS = 16  # rank 0's requests to a rank writing in place go in batches of at most this many pieces


def shares_writes(path: str) -> bool:
    """Whether processes writing ``path`` through different descriptors write one file, as on every kernel file
    system (ext4, xfs, tmpfs, overlay, NFS...): not on a FUSE mount, where each open file may be uploaded whole when
    it is closed (object-store mounts), nor where the file system is unknown (:func:`.space.mount_of`)."""
    kind = space.mount_of(path)[1]
    return bool(kind) and not kind.startswith("fuse")


def hello(handle: Any, file: Path | None) -> tuple[torch.Tensor, bytes]:
    """Rank 0's side of the handshake: ``[boot id, device, inode, length of the path, block]`` of the file it writes
    (``handle``, open on ``file``) and its path, or zeros and no path where the other ranks are to send their pieces
    (no file to share, in-place writes switched off, a file system that does not share writes). ``block``: where the
    file records checksums (a :class:`.checksum.HashingFile`), the block the writers hash their pieces in, else 0."""
    shareable = handle is not None and file is not None and _IN_PLACE
    shareable = shareable and shares_writes(os.path.realpath(str(file)))
    stat = os.fstat(handle.fileno()) if shareable else None
    boot, device = space.file_system_id(stat) if stat else (0, 0)
    path = os.fsencode(os.path.abspath(file)) if boot else b""  # any name the OS takes (undecodable bytes too)
    block = handle.block if boot and isinstance(handle, checksum.HashingFile) else 0
    return torch.tensor([boot, device, stat.st_ino if boot else 0, len(path), block], dtype=torch.int64), path


def open_checkpoint(group: Any) -> tuple[int | None, int]:
    """A source's side of :meth:`.stream_receiver.Receiver.connect`: the file rank 0 writes, open for writing, if
    this rank finds it (the same file under the same kernel), else None, and the pieces are sent; and the block its
    pieces are hashed in (0: the file records no checksums)."""
    import torch.distributed as dist

    hello = torch.zeros(5, dtype=torch.int64)  # boot id, device, inode, length of the path (0: send the pieces), block
    dist.recv(hello, src=0, tag=CONTROL_TAG, group=group)
    boot, device, inode, length, block = hello.tolist()
    fd = None
    if length:
        name = torch.empty(length, dtype=torch.uint8)
        dist.recv(name, src=0, tag=CONTROL_TAG, group=group)
        try:
            fd = os.open(bytes(name.tolist()), os.O_WRONLY)
            stat = os.fstat(fd)
            if (boot, device, inode) != (*space.file_system_id(stat), stat.st_ino):
                os.close(fd)
                fd = None
        except OSError as err:  # not there from here: rank 0 receives the pieces
            log.debug(f"the full checkpoint being written could not be opened on this rank ({err})")
    dist.send(torch.tensor([int(fd is not None)], dtype=torch.int64), dst=0, tag=CONTROL_TAG, group=group)
    return fd, block


def serve(fd: int, pieces: dict[int, torch.Tensor], group: Any, block: int = 0) -> None:
    """A source writing in place: write each piece where rank 0 asks (``[tag, offset, bytes]``; offset -1: skip it, the
    write stopped), then answer once: how many it could not write and how many bytes of checksums follow. After a
    piece that cannot be written the rest are not written either; the first error is raised after the answer. Once a
    batch is written the kernel is asked to start writing it to disk (:func:`.buffers.start_writeback`): this rank
    waits for rank 0 most of the time anyway, and rank 0's fsync at the end then has little more than rank 0's own
    bytes left to wait for. ``block``: each piece is hashed as it is written, from the memory it is written from
    (never read back), in blocks of that size from its start (:func:`.checksum.block_digests`); the digests of the
    pieces written follow the answer, in the order they were asked for."""
    import torch.distributed as dist

    requests, handled, failed, error = torch.zeros(REQUESTS, 3, dtype=torch.int64), 0, 0, None
    digests: list[bytes] = []
    while handled < len(pieces):
        dist.recv(requests, src=0, tag=CONTROL_TAG, group=group)  # a batch (see Receiver.place)
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
                if block:
                    digests.append(checksum.block_digests(buffers.raw(data), block))
                _write_at(fd, data, offset)
                written.append((offset, size))
            except OSError as err:
                error, failed = err, 1
        for offset, size in written:
            buffers.start_writeback(fd, offset, size)
    hashed = b"".join(digests)
    dist.send(torch.tensor([failed, len(hashed)], dtype=torch.int64), dst=0, tag=CONTROL_TAG, group=group)
    if hashed:
        dist.send(torch.frombuffer(bytearray(hashed), dtype=torch.uint8), dst=0, tag=CONTROL_TAG, group=group)
    if error is not None:
        raise error


def _write_at(fd: int, data: torch.Tensor, offset: int) -> None:
    view, done = memoryview(buffers.raw(data)).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def wait(works: list[Any]) -> None:
    for work in works:
        work.wait()
