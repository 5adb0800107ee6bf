"""Long runs: checkpoints in every format in turn with save_top_k=2 leave memory, fds and disk flat.

The default run is shortened (60 steps, a save every 10); ``pytest -m slow`` runs the full 500 steps / every 25.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import BLOCK


def _soak(scenario, tmp_path, steps: int, every: int):
    dirpath = tmp_path / "ckpts"
    module = {"n_samples": 64}
    strategy = {"auto_wrap_policy": [BLOCK]}
    run = scenario(
        {
            "strategy": strategy,
            "module": module,
            "max_steps": steps,
            "model_checkpoint": {
                "dirpath": str(dirpath),
                "every_n_train_steps": every,
                "save_top_k": 2,
                "monitor": "train_loss",
                "mode": "min",
                "save_last": False,
            },
            "soak": {"every": every, "dirpath": str(dirpath), "formats": ["full", "sharded", "local"]},
        },
        timeout=1800,
    )
    straight = scenario({"strategy": strategy, "module": module, "max_steps": steps}).final()
    for key, value in straight["weights"].items():
        assert torch.equal(run.final()["weights"][key], value), key  # checkpointing never changed training
    for rank in (0, 1):
        samples = json.loads((run.out / f"soak{rank}.json").read_text())
        assert len(samples) >= 4
        warm = samples[3:]  # after one save of each format
        rss = [s["rss"] for s in warm]
        assert max(rss) < 1.05 * rss[0], rss
        fds = [s["fds"] for s in warm]
        assert max(fds) - min(fds) <= 2, fds
        assert all(s["checkpoints"] <= 2 for s in samples)
    assert len([p for p in dirpath.iterdir() if not p.name.startswith(".")]) == 2


@pytest.mark.timeout(2100)  # the scenario's own 1800 s, and the straight run after it
def test_soak_short(scenario, tmp_path):
    _soak(scenario, tmp_path, steps=60, every=10)


@pytest.mark.slow
@pytest.mark.timeout(2100)
def test_soak_full(scenario, tmp_path):
    _soak(scenario, tmp_path, steps=500, every=25)
