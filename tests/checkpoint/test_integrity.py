"""Checksums recorded while a checkpoint is written and verified before it is read (one process; the 2-rank damage
matrix is in tests/distributed/test_damage.py)."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch
import xxhash

from lightning_gaudi_fsdp.checkpoint import checksum, formats, integrity, storage
from lightning_gaudi_fsdp.checkpoint.integrity import CheckpointIntegrityError


def _checkpoint() -> dict:
    return {"state_dict": {"w": torch.randn(600, 600), "b": torch.arange(7.0)}, "global_step": 3}


def _save(fmt: str, path, checksums: bool = True):
    return formats.save(fmt, _checkpoint(), path, rank=0, world_size=1, gather=lambda o: [o], checksums=checksums)


def test_a_full_file_carries_its_checksums_in_a_zip_comment_that_every_reader_accepts(tmp_path):
    path = tmp_path / "model.ckpt"
    _save("full", path)
    plain = io.BytesIO()
    with storage.zip_checksums(False):
        torch.save(torch.load(path, weights_only=True), plain)
    assert torch.equal(
        torch.load(path, weights_only=True)["state_dict"]["w"], torch.load(path, mmap=True)["state_dict"]["w"]
    )
    with zipfile.ZipFile(path) as archive:
        assert archive.comment.startswith(checksum.TRAILER_MAGIC)
    digest, covered = checksum.read_trailer(path)
    assert covered == len(plain.getvalue())  # the archive torch.save writes, then only the comment
    assert digest.size == covered
    assert integrity.verify(path)


@pytest.mark.parametrize("fmt", ["full", "sharded", "local"])
def test_a_save_without_checksums_writes_what_it_wrote_before(tmp_path, fmt):
    path = tmp_path / "model.ckpt"
    _save(fmt, path, checksums=False)
    assert not integrity.verify(path)
    if fmt == "full":
        plain = io.BytesIO()
        with storage.zip_checksums(False):  # as the package's saves write them (checkpoint_crc32=False)
            torch.save(torch.load(path, weights_only=True), plain)
        assert path.read_bytes() == plain.getvalue()
    else:
        assert not (path / integrity.MANIFEST).exists()


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_the_ranks_parts_cover_every_block_once(tmp_path, world_size):
    """Every block of every file is read by exactly one rank; each file's presence and size by at least one."""
    path = tmp_path / "model.ckpt"
    _save("sharded", path)
    units = integrity._units(path)
    seen: dict[tuple[str, int], int] = {}
    sized: set[str] = set()
    for rank in range(world_size):
        for unit, blocks, owns_start in integrity._share(units, rank, world_size):
            for index, _, _ in blocks:
                seen[(unit.name, index)] = seen.get((unit.name, index), 0) + 1
            if owns_start or blocks:
                sized.add(unit.name)
    expected = {(u.name, i) for u in units for i in range(len(u.digest.ranges(u.covered)))}
    assert set(seen) == expected
    assert set(seen.values()) == {1}
    assert sized == {u.name for u in units}


def test_a_distributed_checkpoint_is_hashed_entry_by_entry(tmp_path):
    """Blocks end where DCP starts an entry: a changed byte names the one entry it is in."""
    from torch.distributed.checkpoint import FileSystemReader

    path = tmp_path / "model.ckpt"
    _save("sharded", path)
    metadata = FileSystemReader(str(path)).read_metadata()
    key, info = next((k, i) for k, i in metadata.storage_data.items() if k.fqn == "model.w")
    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=rf"file '{info.relative_path}' entry 'model.w' \(bytes"):
        integrity.verify(path)


def test_the_error_names_the_newest_earlier_checkpoint_that_verifies(tmp_path):
    import os

    old, newer, damaged = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt", tmp_path / "epoch=2.ckpt"
    for when, path in enumerate((old, newer, damaged)):
        _save("full", path)
        os.utime(path, (1000 + when, 1000 + when))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    os.utime(damaged, (1002, 1002))
    with pytest.raises(CheckpointIntegrityError, match=rf"newest earlier checkpoint that verifies is '{newer}'"):
        integrity.verify(damaged)
    data = bytearray(newer.read_bytes())
    data[len(data) // 2] ^= 1
    newer.write_bytes(bytes(data))
    os.utime(newer, (1001, 1001))
    with pytest.raises(CheckpointIntegrityError, match=rf"newest earlier checkpoint that verifies is '{old}'"):
        integrity.verify(damaged)


def test_convert_verifies_its_source_and_its_output_carries_checksums(tmp_path):
    from lightning_gaudi_fsdp.checkpoint.convert import convert

    src = tmp_path / "model.ckpt"
    _save("sharded", src)
    assert convert(src, tmp_path / "full.ckpt", "full") == []
    assert integrity.verify(tmp_path / "full.ckpt")
    assert convert(tmp_path / "full.ckpt", tmp_path / "sharded", "sharded") == []
    assert integrity.verify(tmp_path / "sharded")
    (src / "meta.pt").write_bytes((src / "meta.pt").read_bytes()[:-1])
    with pytest.raises(CheckpointIntegrityError, match="file 'meta.pt' is truncated: expected"):
        convert(src, tmp_path / "again", "sharded")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_checkpoint_at_a_url_carries_checksums_and_damage_there_is_refused(s3, fmt):
    """Written through the storage seam to the S3 server: hashed on the way into the upload, verified on the way out;
    one byte changed in the stored object is refused, naming the file."""
    url = f"{s3.url('integrity')}/{fmt}.ckpt"
    _save(fmt, url)
    assert integrity.verify(url)
    data = formats.readable(url)
    victim = data if fmt == "full" else data / "__0_0.distcp"
    body = bytearray(victim.read_bytes())
    body[len(body) // 2] ^= 1
    victim.write_bytes(bytes(body))
    with pytest.raises(CheckpointIntegrityError, match=rf"checksum verification failed: file '{victim.name}'"):
        integrity.verify(url)


def test_pieces_hashed_by_the_rank_that_writes_them_are_blocks_that_verify_recomputes(tmp_path):
    """A streamed full save's pieces written in place by another rank (checkpoint/stream_in_place.py): the file skips
    them in its own hashing, their writer hashes them from its memory, and the digests put in their place are those
    of the blocks read back, wherever the pieces start and end."""
    block = checksum.MIN_BLOCK
    data = torch.randint(0, 256, (5 * block + 12345,), dtype=torch.uint8).numpy().tobytes()
    pieces = [(1000, 1000 + 2 * block + 7), (3 * block + 5, 3 * block + 6), (4 * block, 5 * block)]  # (start, end)
    path = tmp_path / "file"
    with open(path, "wb") as raw:
        handle = checksum.HashingFile(raw, block)
        at = 0
        for key, (start, end) in enumerate(pieces):
            handle.write(data[at:start])
            assert handle.skip(end - start, key) == start
            at = end
        handle.write(data[at:])
        for key, (start, end) in enumerate(pieces):
            with open(path, "r+b") as other:  # the other rank: its own descriptor
                other.seek(start)
                other.write(data[start:end])
            handle.fill(key, checksum.block_digests(data[start:end], block))
        digest = handle.finish()
    assert path.read_bytes() == data
    ranges = digest.ranges()
    for start, end in pieces:  # each piece starts and ends a block
        assert any(s == start for s, _ in ranges)
        assert any(e == end for _, e in ranges)
    for index, (start, end) in enumerate(ranges):
        assert digest.block_digest(index) == xxhash.xxh3_64(data[start:end]).digest(), (start, end)


@pytest.mark.parametrize("size", [1 << 20, 3 << 30, 5 << 40])
def test_a_trailer_holds_the_digests_of_as_many_pieces_as_trailer_fits_allows(size):
    """Where trailer_fits says the pieces fit, the longest trailer such a file can get fits a zip comment."""
    fitting = [parts for parts in (0, 10, 100, 500, 1000, 1300, 1500, 3000) if checksum.trailer_fits(size, parts)]
    assert 1000 in fitting
    assert 3000 not in fitting
    for parts in fitting:
        block = checksum.block_size(size, parts)
        blocks = -(-size // block) + 64 + 2 * parts  # an estimate short by 64 blocks, two more per piece
        cuts = tuple(2 * size - i for i in range(2 * parts))
        worst = checksum.Digest(2 * size, block, b"\xff" * checksum.DIGEST_BYTES * blocks, cuts)
        comment = checksum.TRAILER_MAGIC + json.dumps(worst.to_json(), separators=(",", ":")).encode("ascii")
        assert len(comment) <= 65535, (size, parts, len(comment))
