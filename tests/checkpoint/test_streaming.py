"""Full checkpoints written as their tensors arrive (``checkpoint/streaming.py``), in one process: the file is the one
``torch.save`` writes of the same state. The 2-rank cases (pieces sent by another rank, rank 0's memory, a write failing
midway) run in the FSDP1/FSDP2 state scenarios (``test_fsdp1_state.py``, ``test_fsdp2_state.py``) and in the Trainer's
and Fabric's resume tests."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_gaudi_fsdp.checkpoint import space, stream_in_place, streaming
from lightning_gaudi_fsdp.checkpoint.storage import zip_checksums
from lightning_gaudi_fsdp.checkpoint.streaming import FullStream

pytestmark = pytest.mark.versions


def _planned(stream: FullStream, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` gathered through ``stream`` in one process: a placeholder that rank 0's own piece fills."""
    flat = tensor.reshape(-1)
    return stream.gather(tuple(tensor.shape), [(0, flat.numel())], flat, [0], tensor.dtype)


@pytest.mark.filterwarnings("error")  # e.g. torch's about a read-only buffer, which the writer's data is
@pytest.mark.parametrize("crc32", [False, True], ids=["pieces written directly", "assembled for a CRC32"])
def test_a_streamed_file_is_the_file_torch_save_writes(tmp_path, crc32):
    assert streaming.available()  # the private writer has the signature checked on torch 2.6, 2.9 and 2.13
    torch.manual_seed(0)
    # more than ten tensors (torch < 2.7 writes them sorted as strings: 0, 1, 10, 11, 2...), several dtypes, nested
    # optimizer state, a real tensor among the placeholders, a shared storage, an empty tensor
    weights = {f"layer{i}.weight": torch.randn(3 + i, 5) for i in range(12)}
    moments = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(7).to(torch.bfloat16)} for i in range(3)}
    shared = torch.arange(10)
    state = {
        "state_dict": {**weights, "buffer": torch.ones(4, dtype=torch.int64), "empty": torch.empty(0, 3)},
        "optimizer_states": [{"state": moments, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}],
        "shared": [shared, shared[2:5]],
        "epoch": 3,
    }
    stream = FullStream(rank=0)
    planned = {
        "state_dict": {
            **{k: _planned(stream, v) for k, v in weights.items()},
            "buffer": state["state_dict"]["buffer"],
            "empty": _planned(stream, state["state_dict"]["empty"]),
        },
        "optimizer_states": [
            {
                "state": {i: {**m, "exp_avg": _planned(stream, m["exp_avg"])} for i, m in moments.items()},
                "param_groups": state["optimizer_states"][0]["param_groups"],
            }
        ],
        "shared": state["shared"],
        "epoch": 3,
    }
    assert stream.pending
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch's warnings that warn once would otherwise have warned before this test
    try:
        with zip_checksums(crc32):  # without: torch's writer hands over each placeholder, and the pieces are written
            stream.write(planned, tmp_path / "streamed.pt")
            with open(tmp_path / "torch.pt", "wb") as handle:  # as the eager path saves (formats.save_file)
                torch.save(state, handle)
    finally:
        torch.set_warn_always(warn_always)
    assert (tmp_path / "streamed.pt").read_bytes() == (tmp_path / "torch.pt").read_bytes()
    loaded = torch.load(tmp_path / "streamed.pt", weights_only=True, mmap=True)
    assert list(loaded["state_dict"]) == list(state["state_dict"])
    assert torch.equal(loaded["optimizer_states"][0]["state"][2]["exp_avg"], moments[2]["exp_avg"])
    assert loaded["shared"][1].untyped_storage().data_ptr() == loaded["shared"][0].untyped_storage().data_ptr()


@pytest.mark.parametrize("crc32", [False, True], ids=["pieces written directly", "assembled for a CRC32"])
def test_pieces_that_leave_elements_out_fail_the_write_instead_of_writing_what_a_placeholder_holds(tmp_path, crc32):
    stream = FullStream(rank=0)
    tensor = torch.arange(10.0)
    planned = stream.gather((10,), [(0, 8)], tensor[:8], [0], tensor.dtype)  # elements 8 and 9 come from nowhere
    with zip_checksums(crc32), pytest.raises(RuntimeError, match=r"shape \(10,\) leave elements \[8, 10\) out"):
        stream.write({"weight": planned}, tmp_path / "streamed.pt")


def test_other_ranks_write_in_place_only_on_file_systems_that_share_writes(tmp_path, monkeypatch):
    """A rank on rank 0's host writes its pieces into the file itself only where two descriptors of one file write
    the same file: a kernel file system, not a FUSE mount (an object-store mount may upload each open file whole when
    it is closed, so one rank's writes would replace the other's); unknown: the pieces are sent."""
    mounts = tmp_path / "mountinfo"
    mounts.write_bytes(
        b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        b"30 22 0:40 / /mnt/bucket rw,nosuid,nodev - fuse.gcsfuse ckpts rw,user_id=0\n"
        b"31 22 0:41 / /mnt/my\\040runs rw - xfs /dev/vdb rw\n"
        b"32 30 0:42 / /mnt/bucket/scratch rw - tmpfs tmpfs rw\n"
        b"33 22 0:43 / /mnt/ntfs rw - fuseblk /dev/vdc rw\n"
        b"34 22 0:44 / /mnt/ckpt-\xff rw - xfs /dev/vdd rw\n"  # a name that is not UTF-8, as the kernel writes it
    )
    monkeypatch.setattr(space, "MOUNTS", str(mounts))  # the one table the free-space check reads too
    assert space.mount_of("/home/u/run/last.ckpt") == ("/", "ext4")
    assert space.mount_of("/mnt/bucket/run/last.ckpt") == ("/mnt/bucket", "fuse.gcsfuse")
    assert space.mount_of("/mnt/bucketful/last.ckpt") == ("/", "ext4")  # a mount point is a whole path component
    assert space.mount_of("/mnt/my runs/last.ckpt") == ("/mnt/my runs", "xfs")  # mountinfo writes a space as \040
    assert space.mount_of("/mnt/bucket/scratch/last.ckpt") == ("/mnt/bucket/scratch", "tmpfs")  # the deepest wins
    undecodable = os.fsdecode(b"/mnt/ckpt-\xff")
    assert space.mount_of(f"{undecodable}/last.ckpt") == (undecodable, "xfs")
    assert [
        stream_in_place.shares_writes(path)
        for path in ("/home/u/last.ckpt", "/mnt/bucket/last.ckpt", "/mnt/ntfs/last.ckpt", "/mnt/bucket/scratch/x")
    ] == [True, False, False, True]
    monkeypatch.setattr(space, "MOUNTS", str(tmp_path / "missing"))
    assert space.mount_of("/home/u/last.ckpt") == ("", "")
    assert not stream_in_place.shares_writes("/home/u/last.ckpt")
