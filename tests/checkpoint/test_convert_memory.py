"""``convert`` holds about one model in memory, not one per rank: measured on a 2-rank checkpoint of ~100 MB."""

from __future__ import annotations

import json

import pytest

# ~25M fp32 parameters, ~100 MB, in 24 blocks of ~4 MB (an export file holds several tensors, as a real model's do)
BIG = {"width": 1024, "depth": 24, "n_samples": 16, "optimizer": "sgd"}


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A local checkpoint of a ~100 MB model, saved by 2 ranks."""
    from conftest import run_script

    tmp = tmp_path_factory.mktemp("big")
    strategy = {"auto_wrap_policy": ["common.Block"], "state_dict_type": "local"}
    run_script("train.py", {"strategy": strategy, "module": BIG, "max_steps": 1, "save_path": str(tmp / "local")}, tmp)
    return tmp / "local"


@pytest.fixture(scope="module")
def converted(tmp_path_factory, local):
    """local -> full -> sharded -> full in one process: what each conversion added, and the checkpoints."""
    from conftest import run_script

    tmp = tmp_path_factory.mktemp("converted")
    full, sharded, full_again = tmp / "full.ckpt", tmp / "sharded", tmp / "again.ckpt"
    cfg = {
        "conversions": [
            [str(local), str(full), "full"],
            [str(full), str(sharded), "sharded"],
            [str(sharded), str(full_again), "full"],
        ]
    }
    run = run_script("convert_memory.py", cfg, tmp, single_process=True)
    return json.loads((run.out / "memory.json").read_text()), {"local": local, "full": full, "sharded": sharded}


def test_conversions_add_about_one_model_of_memory(converted):
    measured, _ = converted
    print(json.dumps(measured, indent=1))
    for name, m in measured.items():
        ratio = m["peak_added"] / m["model_bytes"]
        # A gathered model must be in memory once (ratio ~1); holding every rank's pieces beside it would be ~2.
        assert ratio < 1.5, f"{name}: conversion added {ratio:.2f} models of memory"
    assert measured["local->full"]["peak_added"] > 0.8 * measured["local->full"]["model_bytes"]  # sampler sees it


def test_hf_export_streams_about_one_output_file(scenario, tmp_path, converted):
    """``convert --to hf`` from each format holds about one output file, not the model: ~100 MB model written in
    10 MB files, each export measured in a fresh process. What one file costs: its tensors, safetensors' serialised
    copy of them and the read of one tensor (DCP reads a tensor's bytes, then the tensor); loading the model first,
    as ``--to full`` does, would be >= 1.0."""
    _, sources = converted
    exports = [
        [str(src), str(tmp_path / f"hf-{fmt}"), {"max_shard_size": "10MB", "prefix": "net."}]
        for fmt, src in sources.items()
    ]
    run = scenario({"exports": exports}, script="convert_memory.py", single_process=True)
    measured = {k: m for k, m in json.loads((run.out / "memory.json").read_text()).items() if k.endswith("->hf")}
    print(json.dumps(measured, indent=1))
    assert len(measured) == 3
    for name, m in measured.items():
        assert m["files"] >= 10, m
        assert m["largest_file"] <= 10 * 10**6, m
        assert m["peak_added"] < 4 * 10 * 10**6, f"{name}: {m['peak_added'] / 1e6:.1f} MB for 10 MB files"
        assert m["peak_added"] < 0.4 * m["model_bytes"], f"{name}: {m['peak_added'] / m['model_bytes']:.2f} models"
