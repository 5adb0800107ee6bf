"""``convert`` holds about one model in memory, not one per rank: measured on a 2-rank checkpoint of ~100 MB."""

from __future__ import annotations

import json

import pytest

BIG = {"width": 2048, "depth": 6, "n_samples": 16, "optimizer": "sgd"}  # ~25M fp32 parameters, ~100 MB


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A local checkpoint of a ~100 MB model, saved by 2 ranks."""
    from conftest import run_script

    tmp = tmp_path_factory.mktemp("big")
    strategy = {"auto_wrap_policy": ["common.Block"], "state_dict_type": "local"}
    run_script("train.py", {"strategy": strategy, "module": BIG, "max_steps": 1, "save_path": str(tmp / "local")}, tmp)
    return tmp / "local"


def test_conversions_add_about_one_model_of_memory(scenario, tmp_path, local):
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


def test_hf_export_streams_about_one_output_file(scenario, tmp_path, local):
    """``convert --to hf`` from each format holds about one output file (and one FSDP unit of a local checkpoint),
    not the model: ~100 MB model, 20 MB files, every peak well under half the model."""
    full, sharded = tmp_path / "full.ckpt", tmp_path / "sharded"
    exports = [
        [str(src), str(tmp_path / f"hf-{src.name}"), {"max_shard_size": "20MB", "prefix": "net."}]
        for src in (local, full, sharded)
    ]
    run = scenario(
        {"conversions": [[str(local), str(full), "full"], [str(local), str(sharded), "sharded"]], "exports": exports},
        script="convert_memory.py",
        single_process=True,
    )
    measured = {k: m for k, m in json.loads((run.out / "memory.json").read_text()).items() if k.endswith("->hf")}
    print(json.dumps(measured, indent=1))
    assert len(measured) == 3
    for name, m in measured.items():
        assert m["files"] >= 5, m  # split: 20 MB files of a ~100 MB model
        assert m["largest_file"] <= 20 * 10**6, m
        # a streaming export holds one file (and its serialised bytes, and one 17 MB flat unit for local); loading
        # the model first, as load_full_state does, would be >= 1.0
        assert m["peak_added"] < 0.5 * m["model_bytes"], f"{name}: {m['peak_added'] / m['model_bytes']:.2f} models"
