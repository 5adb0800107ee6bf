"""``convert`` holds about one model in memory, not one per rank: measured on a 2-rank checkpoint of ~100 MB."""

from __future__ import annotations

import json

BIG = {"width": 2048, "depth": 6, "n_samples": 16, "optimizer": "sgd"}  # ~25M fp32 parameters, ~100 MB


def test_conversions_add_about_one_model_of_memory(scenario, tmp_path):
    strategy = {"auto_wrap_policy": ["common.Block"], "state_dict_type": "local"}
    local = tmp_path / "local"
    scenario({"strategy": strategy, "module": BIG, "max_steps": 1, "save_path": str(local)})
    full, sharded, full_again = tmp_path / "full.ckpt", tmp_path / "sharded", tmp_path / "again.ckpt"
    run = scenario(
        {
            "conversions": [
                [str(local), str(full), "full"],
                [str(full), str(sharded), "sharded"],
                [str(sharded), str(full_again), "full"],
            ]
        },
        script="convert_memory.py",
        single_process=True,
    )
    measured = json.loads((run.out / "memory.json").read_text())
    print(json.dumps(measured, indent=1))
    for name, m in measured.items():
        ratio = m["peak_added"] / m["model_bytes"]
        # A gathered model must be in memory once (ratio ~1); holding every rank's pieces beside it would be ~2.
        assert ratio < 1.5, f"{name}: conversion added {ratio:.2f} models of memory"
    assert measured["local->full"]["peak_added"] > 0.8 * measured["local->full"]["model_bytes"]  # sampler sees it
