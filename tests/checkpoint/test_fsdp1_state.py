"""FSDP1 sharded and full state dicts built from each rank's own flat-parameter slices (``engine/fsdp1_state.py``):
the checkpoint content equals torch's own, bitwise, while no parameter or optimizer state is all-gathered."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from lightning_gaudi_fsdp.engine.fsdp1_state import row_major_boxes

pytestmark = pytest.mark.versions

# what differs between the gathered full state and the streamed files of tests/scenarios/fsdp1_state.py: nothing
STREAMED_AS_GATHERED = {
    "load": [],
    "mmap": [],
    "crc32": [],
    "received": [],
    "crc32_mismatch": None,
    "received_same_bytes": True,
    "verified": True,
}


def check_streamed(result: dict, world_size: int) -> None:
    """The streamed saves of tests/scenarios/fsdp1_state.py, checksums recorded (the default): the other ranks write
    their pieces into the file themselves, hashing them as they write them; with CRC32s (rank 0 reads every byte)
    rank 0 receives them, and from the last rank when it reads another boot id (as on another host), while the others
    still write theirs. Each file reads back as the gathered state (plainly, memory-mapped; the CRC32s right), the one
    written in place verifies, and a byte changed inside a piece the last rank wrote is found, in the bytes it is in."""
    on_another_host = "received" if world_size == 2 else "in place + received"
    assert result["streamed_planned"] == ["in place", "received", on_another_host]
    differences = dict(result["streamed_differences"])
    flipped = differences.pop("flipped")
    assert differences == STREAMED_AS_GATHERED
    assert flipped is not None
    assert flipped["rank"] == world_size - 1, flipped
    message = flipped["message"]
    assert message is not None, flipped
    assert "checksum verification failed: file 'streamed.ckpt'" in message, message
    found = re.search(r"\(bytes (\d+) to (\d+)\) does not match", message)
    assert found, message
    assert int(found[1]) <= flipped["offset"] < int(found[2]), message


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (1, 6), (2, 2, 2, 3)])
def test_a_run_of_elements_is_covered_by_few_boxes_in_order(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for end in range(start, numel + 1):
            boxes = row_major_boxes(shape, start, end)
            assert len(boxes) <= max(1, 2 * len(shape) - 1) if end > start else not boxes
            pieces = [full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))] for b in boxes]
            flat = torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.empty(0, dtype=torch.long)
            assert torch.equal(flat, torch.arange(start, end)), (shape, start, end, boxes)


@pytest.mark.parametrize(
    ("use_orig_params", "buffer_dtype", "world_size"),
    [(True, "float32", 2), pytest.param(False, "bfloat16", 3, marks=pytest.mark.slow)],
)
def test_sharded_and_full_state_equal_torchs_bitwise(scenario, use_orig_params, buffer_dtype, world_size):
    cfg = {
        "use_orig_params": use_orig_params,
        "buffer_dtype": buffer_dtype,
        "devices": world_size,
        "stream_memory": world_size == 2,
    }
    run = scenario(cfg, script="fsdp1_state.py")
    result = json.loads((run.out / "fsdp1_state.json").read_text())
    assert result["sharded_fast"]
    assert result["full_fast"]
    assert result["sharded_differences"] == []  # the DCP checkpoints consolidate to the same tensors
    assert result["full_differences"] == []  # weights and optimizer state (by parameter id) on rank 0
    assert result["full_model_keys_in_order"]
    assert result["buffer_dtype"] == "torch.float32"  # bf16 buffers saved in their own dtype, as torch saves them
    # local: the flat shards and buffers torch's hooks would give, without their all_gather_object per unit
    assert result["local_same_as_torchs"]
    assert result["local_keys"] == ["0._flat_param", "0.scale", "1._flat_param", "1.scale", "_flat_param"]
    assert result["local_keys_with_foreign_hook"] == sorted([*result["local_keys"], "0.extra"])
    check_streamed(result, world_size)  # streamed (checkpoint/streaming.py), checksums recorded
    if world_size == 2:
        _check_stream_memory_and_failure(run.out)


def _check_stream_memory_and_failure(out):
    """A streamed full save adds to rank 0's memory about its receive ring at most, not the state (an eager save
    adds the state); a write that fails midway fails on every rank, quickly, on rank 0 whether rank 1 writes its
    pieces in place or sends them, and on rank 1 writing in place; nothing is left, and the next save succeeds."""
    records = [json.loads((out / f"stream_memory{rank}.json").read_text()) for rank in (0, 1)]
    zero = records[0]
    assert zero["streamed_planned"]
    assert not zero["eager_planned"]
    assert zero["eager_peak_growth"] > 0.6 * zero["state_bytes"], zero  # the measurement sees a gathered state
    assert zero["streamed_peak_growth"] < 0.25 * zero["state_bytes"], zero  # a ring of two 4 MiB pieces
    for failure in ("failure", "failure_received", "failure_writer"):
        assert [r[failure]["type"] for r in records] == ["CheckpointSaveError"] * 2, records
        assert records[0][failure]["message"] == records[1][failure]["message"]
        assert all(r[f"{failure}_seconds"] < 20 for r in records), records
        assert zero[f"left{failure[7:]}"] == []  # nothing staged is left behind
    for failure in ("failure", "failure_received"):
        assert "rank 0 failed while writing" in zero[failure]["message"]
        assert "File too large" in zero[failure]["message"], zero[failure]
    message = zero["failure_writer"]["message"]  # rank 1's own error, and rank 0's word that rank 1 failed
    assert "ranks 0, 1 failed while writing" in message, message
    assert "rank(s) [1] could not write their pieces of the full checkpoint into the file" in message, message
    assert "File too large" in message, message
    assert all(r["after_failure_planned"] for r in records)
    assert zero["after_failure_keys"] == 6
