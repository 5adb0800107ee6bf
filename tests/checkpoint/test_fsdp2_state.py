"""FSDP2 full state dicts gathered by the package (``engine/fsdp2_state.py``): each rank sends its dim-0 chunk of
every parameter and optimizer state straight to rank 0, and the result equals torch's full state dicts bitwise."""

from __future__ import annotations

import json

import pytest

from checkpoint.test_fsdp1_state import check_streamed

pytestmark = [pytest.mark.versions, pytest.mark.fsdp2]


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_full_state_equals_torchs_bitwise(scenario, world_size):
    run = scenario({"devices": world_size}, script="fsdp2_state.py")
    result = json.loads((run.out / "fsdp2_state.json").read_text())
    assert result["gathers_to_rank0"]  # the package's gather applied, not torch's fallback
    assert result["differences"] == []  # weights, buffers, AdamW state and param groups on rank 0
    assert result["model_keys_in_order"]
    assert result["optimizer_keys_in_order"]
    check_streamed(result, world_size)  # streamed (checkpoint/streaming.py), checksums recorded
    for rank in range(1, world_size):  # only rank 0 holds the full state
        assert json.loads((run.out / f"fsdp2_state_rank{rank}.json").read_text()) == {"model": 0, "optimizer": 0}
