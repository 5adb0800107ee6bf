"""FSDP1 sharded and full state dicts built from each rank's own flat-parameter slices (``engine/fsdp1_state.py``):
the checkpoint content equals torch's own, bitwise, while no parameter or optimizer state is all-gathered."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_gaudi_fsdp.engine.fsdp1_state import row_major_boxes

pytestmark = pytest.mark.versions


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
    cfg = {"use_orig_params": use_orig_params, "buffer_dtype": buffer_dtype, "devices": world_size}
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
