"""Lightning Fabric through lightning_gaudi_fsdp.fabric.GaudiFSDPStrategy: a plain loop on 2 CPU ranks (scenario
script fabric_loop.py) equals one process, resumes exactly from each format on both engines, and shares checkpoints
with the Trainer's strategy."""

from __future__ import annotations

import pytest
import torch

from distributed.test_resume import _assert_equal_nested  # bitwise, nested

BLOCK = "common.Block"
FABRIC = "fabric_loop.py"


def _strategy(engine: int, fmt: str = "full") -> dict:
    return {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine}


@pytest.mark.versions
@pytest.mark.parametrize("engine", [1, 2])
def test_fabric_loop_equals_one_process_on_the_global_batch(scenario, engine):
    """Accumulation under no_backward_sync, clipping by value then by the global norm, AdamW + StepLR: 2 ranks equal
    a plain model trained on each whole global batch. Engine 1 takes the strategy by its registered name."""
    cfg = {"reference": True, "clip_value": 0.05, "clip_norm": 0.1, "epochs": 2}
    if engine == 1:
        cfg["strategy_name"] = "gaudi_fsdp"
    else:
        cfg["strategy"] = _strategy(engine)
    run = scenario(cfg, script=FABRIC)
    final = run.final()
    reference = final["reference"]
    rank0, rank1 = run.rank(0), run.rank(1)
    assert rank0["strategy"] == "lightning_gaudi_fsdp.fabric.GaudiFSDPStrategy"
    assert rank0["engine"] == engine
    assert rank0["precision"] == "GaudiFabricFSDPPrecision"
    assert rank0["meta_before_setup"]  # fabric.init_module(empty_init=True)
    assert rank0["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert rank0["losses"] == rank1["losses"]
    assert rank0["norms"] == pytest.approx(reference["norms"], abs=1e-5)  # the global norm, not a shard's
    assert min(rank0["norms"]) > 0.1  # clipping was active
    assert final["lr"] == reference["lr"] == 0.01 * 0.5**3
    assert final["weights"].keys() == reference["weights"].keys()
    for key, value in reference["weights"].items():
        torch.testing.assert_close(final["weights"][key], value, atol=1e-5, rtol=0)
    for info in (rank0, rank1):  # collectives
        assert info["all_reduce_sum"] == 3.0
        assert info["all_reduce_mean"] == 1.5
        assert info["all_gather"] == [0, 1]
        assert info["broadcast"] == {"from": 0}


@pytest.mark.parametrize(
    ("engine", "fmt"), [(1, "full"), (1, "sharded"), (1, "local"), (2, "full"), (2, "sharded"), (2, "local")]
)
def test_fabric_resume_equals_the_uninterrupted_run(scenario, tmp_path, engine, fmt):
    """Save at the end of epoch 1 of 2 and keep going; a new run loads that checkpoint and finishes epoch 2: weights,
    optimizer and scheduler equal the uninterrupted run bitwise, the scheduler restored in place, plain values back
    in ``state``."""
    ckpt = tmp_path / "ckpt"
    common = {"strategy": _strategy(engine, fmt), "clip_norm": 0.1, "epochs": 2}
    straight = scenario({**common, "save": str(ckpt), "save_after_epoch": 1}, script=FABRIC)
    resumed = scenario({**common, "load": str(ckpt)}, script=FABRIC)
    a, b = straight.final(), resumed.final()
    _assert_equal_nested(b["weights"], a["weights"], "weights")
    _assert_equal_nested(b["optimizer"], a["optimizer"], "optimizer")
    assert b["scheduler"] == a["scheduler"]
    info = resumed.rank(1)
    assert info["scheduler_same_object"]
    assert info["scheduler_last_epoch"] == 3
    assert info["lr_after_load"] == 0.005
    assert info["loaded"] == {"epoch": 1, "global_step": 3}
    assert info["remainder_keys"] == []
    assert info["missing_error"] == (
        f"CheckpointError: Cannot load checkpoint '{ckpt}.missing': no such file or directory (reported by rank 0)"
    )
    assert info["losses"] == straight.rank(1)["losses"][3:]
    assert info["final_state"] == {"epoch": 2, "global_step": 6}


@pytest.mark.versions
def test_checkpoints_cross_between_the_trainer_and_fabric(scenario, tmp_path):
    """A sharded checkpoint of the Trainer's strategy loads in Fabric (model, optimizer, its scheduler from
    ``lr_schedulers``, ``global_step``), and one Fabric saved resumes a Trainer."""
    strategy = _strategy(1, "sharded")
    trainer_ckpt, fabric_ckpt = tmp_path / "trainer.ckpt", tmp_path / "fabric.ckpt"
    module = {"n_samples": 32, "batch_size": 4}
    trained = scenario({"strategy": strategy, "module": module, "max_steps": 4, "save_path": str(trainer_ckpt)})
    loaded = scenario({"strategy": strategy, "load": str(trainer_ckpt), "epochs": 0}, script=FABRIC)
    saved, restored = trained.final(), torch.load(loaded.out / "loaded.pt", weights_only=False)
    _assert_equal_nested(restored["weights"], saved["weights"], "weights")
    _assert_equal_nested(restored["optimizer"], saved["optimizer"], "optimizer")
    assert restored["scheduler"] == saved["schedulers"][0]
    assert loaded.rank(0)["loaded"] == {"epoch": 1, "global_step": 4}  # the Trainer's own entries

    fabric = scenario({"strategy": strategy, "epochs": 1, "save": str(fabric_ckpt)}, script=FABRIC)
    resumed = scenario(
        {"strategy": strategy, "module": module, "max_steps": 1, "ckpt_path": str(fabric_ckpt), "start_state": True}
    )
    written, start = fabric.final(), torch.load(resumed.out / "start.pt", weights_only=False)
    _assert_equal_nested(start["weights"], written["weights"], "weights")
    _assert_equal_nested(start["optimizer"], written["optimizer"], "optimizer")
    assert start["schedulers"] == [written["scheduler"]]
