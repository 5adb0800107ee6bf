"""Lightning Fabric through lightning_gaudi_fsdp.fabric.GaudiFSDPStrategy: a plain loop on 2 CPU ranks (scenario
script fabric_loop.py) equals one process, resumes exactly from each format on both engines, and shares checkpoints
with the Trainer's strategy."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys

import pytest
import torch

from conftest import SCENARIOS
from distributed.test_resume import _assert_equal_nested  # bitwise, nested
from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint.convert import describe

FABRIC = "fabric_loop.py"


def _strategy(engine: int, fmt: str = "full") -> dict:
    return {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine}


@pytest.mark.versions
@pytest.mark.parametrize("engine", [1, 2])
def test_fabric_loop_equals_one_process_on_the_global_batch(scenario, tmp_path, engine):
    """Accumulation under no_backward_sync, clipping by value then by the global norm, AdamW + StepLR: 2 ranks equal
    a plain model trained on each whole global batch. Engine 1 takes the strategy by its registered name, with its
    defaults: the checkpoint saved at the end is sharded, as Lightning's Fabric ``FSDPStrategy`` saves by default.
    Engine 2 saves a full one, in Lightning Fabric's layout: as LitGPT reads one, ``torch.load(path)["model"]``
    loads strictly into the plain model (here the scenario's ``Module``, standing in for a LitGPT ``GPT``), whose
    outputs equal the trained model's."""
    ckpt = tmp_path / "fabric.ckpt"
    cfg = {"reference": True, "clip_value": 0.05, "clip_norm": 0.1, "epochs": 2}
    cfg.update(save=str(ckpt), save_after_epoch=2)
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
    # rank 0 printed the configuration table once, when Fabric set the model up (after the ranks agreed on it)
    output = run.proc.stdout + run.proc.stderr
    assert output.count("GaudiFSDPStrategy configuration:") == 1
    assert re.search(r"Fabric precision +: 32-true\n", output)
    assert re.search(rf"engine +: FSDP{engine} ", output)
    for info in (rank0, rank1):  # collectives
        assert info["all_reduce_sum"] == 3.0
        assert info["all_reduce_mean"] == 1.5
        assert info["all_gather"] == [0, 1]
        assert info["broadcast"] == {"from": 0}
    if engine == 1:
        assert (ckpt / ".metadata").is_file()  # sharded: each rank wrote its own shards
    else:
        _assert_loads_as_litgpt_does(ckpt, final["weights"])


def _damaged_copy(ckpt, dst):
    """A copy of ``ckpt`` with one byte changed in the middle of its largest file."""
    (shutil.copytree if ckpt.is_dir() else shutil.copy)(ckpt, dst)
    largest = dst if dst.is_file() else max((p for p in dst.iterdir()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    return dst


def _assert_loads_as_litgpt_does(ckpt, trained: dict[str, torch.Tensor]) -> None:
    """Fabric's full layout, read in this process (not the one that saved it) the way LitGPT reads a checkpoint."""
    sys.path.insert(0, str(SCENARIOS))
    from common import Module

    saved = torch.load(ckpt, weights_only=True)
    assert list(saved) == ["model", "optimizer", "scheduler", "epoch", "global_step", "gaudi_fsdp"]
    assert saved["epoch"] == 2
    assert saved["global_step"] == 6
    assert saved["scheduler"]["last_epoch"] == 6
    # the optimizer as Lightning's Fabric FSDPStrategy keys it (FSDP.optim_state_dict): by parameter name
    assert sorted(saved["optimizer"]["state"]) == sorted(saved["model"])
    assert sorted(saved["optimizer"]["param_groups"][0]["params"]) == sorted(saved["model"])
    plain = Module(depth=3)
    plain.load_state_dict(saved["model"], strict=True)
    trained_model = Module(depth=3)
    trained_model.net.load_state_dict(trained, strict=True)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(plain(x), trained_model(x))


@pytest.mark.parametrize(
    ("engine", "fmt", "background"),
    [
        (1, "full", False),
        (1, "sharded", False),
        (1, "local", False),
        (2, "full", False),
        (2, "sharded", False),
        (2, "local", False),
        (1, "sharded", True),
        pytest.param(2, "local", True, marks=pytest.mark.slow),
        pytest.param(2, "full", True, marks=pytest.mark.slow),
    ],
)
def test_fabric_resume_equals_the_uninterrupted_run(scenario, tmp_path, engine, fmt, background):
    """Save at the end of epoch 1 of 2 and keep going; a new run loads that checkpoint and finishes epoch 2: weights,
    optimizer and scheduler equal the uninterrupted run bitwise, the scheduler restored in place, plain values back
    in ``state``. ``background``: ``async_save=True`` with 1 s writes, so fabric.save returns before the checkpoint
    is committed and epoch 2 trains while it is written; the copies of parameters and optimizer state start 0.5 s
    late, so epoch 2's first ``optimizer.step()`` must wait for them (or the save fails: they would have changed).
    The resumed runs also check ``fabric.load_raw`` (and, for full checkpoints, ``fabric.save(filter=...)``)."""
    ckpt = tmp_path / "ckpt"
    strategy = {**_strategy(engine, fmt), "async_save": background}
    common = {"strategy": strategy, "clip_norm": 0.1, "epochs": 2}
    writes = {"slow_writes": 1.0, "slow_copies": 0.5} if background else {}
    if fmt != "local" and not background:  # beside it, the same state in Lightning's own Fabric layout
        writes["lightning_layout"] = str(tmp_path / "lightning.ckpt")
    straight = scenario({**common, **writes, "save": str(ckpt), "save_after_epoch": 1}, script=FABRIC)
    damaged = _damaged_copy(ckpt, tmp_path / "damaged")  # fabric.load refuses it first, on every rank
    load = {"load": str(ckpt), "load_damaged": str(damaged), "raw_checks": not background}
    resumed = scenario({**common, **load}, script=FABRIC)
    a, b = straight.final(), resumed.final()
    _assert_equal_nested(b["weights"], a["weights"], "weights")
    _assert_equal_nested(b["optimizer"], a["optimizer"], "optimizer")
    assert b["scheduler"] == a["scheduler"]
    for rank in (0, 1):
        save = straight.rank(rank)["save"]
        # with async_save, fabric.save returned while the 1 s write was still going on
        assert save["in_flight"] is background, save
        assert save["committed_on_return"] is not background, save
        if background:
            assert save["seconds"] < 1.0, save
        assert straight.rank(rank)["committed_after_teardown"]
    # a synchronous full save (no filter) is streamed (checkpoint/streaming.py); the loads above read it back exactly
    assert straight.rank(0)["save"]["streamed"] is (fmt == "full" and not background)
    assert straight.rank(0)["save"]["streamed_by_teardown"] is (fmt == "full")  # async: in the background
    for rank in (0, 1):
        info = resumed.rank(rank)
        assert info["damaged_error"].startswith(f"CheckpointIntegrityError: Cannot load checkpoint '{damaged}'"), info
        assert "checksum verification failed" in info["damaged_error"]
        assert info["damaged_unchanged"]
    info = resumed.rank(1)
    assert info["scheduler_same_object"]
    assert info["scheduler_last_epoch"] == 3
    assert info["lr_after_load"] == 0.005
    assert info["loaded"] == {"epoch": 1, "global_step": 3}
    assert info["remainder_keys"] == []  # nothing of the package's own record (engine, world size) comes back
    assert describe(ckpt)["world_size"] == (None if fmt == "full" else 2)  # the writers, as `inspect` shows them
    assert info["missing_error"] == (
        f"CheckpointError: Cannot load checkpoint '{ckpt}.missing': no such file or directory (reported by rank 0)"
    )
    assert info["losses"] == straight.rank(1)["losses"][3:]
    assert info["final_state"] == {"epoch": 2, "global_step": 6}
    if not background:
        _assert_load_raw_and_filter(resumed, ckpt, fmt)
    if fmt != "local" and not background:
        _assert_lightning_layout_resumes(scenario, common, straight, tmp_path / "lightning.ckpt")


def _assert_lightning_layout_resumes(scenario, common: dict, straight, lightning_ckpt) -> None:
    """A checkpoint in the layout Lightning's own Fabric writes (made by the straight run beside its own save: sharded
    by Lightning's code, full as its source builds it; see fabric_loop.save_lightning_layout) loads with fabric.load
    into this package's strategy and training continues exactly as the uninterrupted run."""
    assert describe(lightning_ckpt)["layout"] == "fabric"
    if lightning_ckpt.is_dir():  # sharded: DCP keys of the state, the other entries in meta.pt, nothing of ours
        from torch.distributed.checkpoint import FileSystemReader

        entries = FileSystemReader(str(lightning_ckpt)).read_metadata().state_dict_metadata
        assert {key.split(".", 1)[0] for key in entries} == {"model", "optimizer"}
        assert set(torch.load(lightning_ckpt / "meta.pt", weights_only=True)) == {"scheduler", "epoch", "global_step"}
    resumed = scenario({**common, "load": str(lightning_ckpt)}, script=FABRIC)
    a, b = straight.final(), resumed.final()
    _assert_equal_nested(b["weights"], a["weights"], "weights")
    _assert_equal_nested(b["optimizer"], a["optimizer"], "optimizer")
    assert b["scheduler"] == a["scheduler"]
    info = resumed.rank(1)
    assert info["scheduler_same_object"]
    assert info["loaded"] == {"epoch": 1, "global_step": 3}
    assert info["remainder_keys"] == []


def _assert_load_raw_and_filter(run, ckpt, fmt: str) -> None:
    """fabric.load_raw from the checkpoint (any format) and from a plain torch.save file into a set-up model and a
    plain one, an optimizer alone from a full checkpoint; for full, fabric.save(filter=...) and strict loading."""
    for rank in (0, 1):
        raw = run.rank(rank)["raw"]
        assert raw["checkpoint_into_set_up"]
        assert raw["checkpoint_into_plain"]
        assert raw["raw_into_set_up"]
        assert raw["raw_into_plain"]
        assert raw["missing_error"] == (
            f"CheckpointError: Cannot load checkpoint '{ckpt}.missing': no such file or directory (reported by rank 0)"
        )
        if fmt != "full":
            assert raw["optimizer_error"] == (
                f"CheckpointError: Cannot load checkpoint '{ckpt}': an optimizer alone loads from a single file (a "
                "full checkpoint or torch.save(optimizer.state_dict())); load sharded and local checkpoints with "
                "their model: fabric.load(path, {'model': model, 'optimizer': optimizer}) (reported by rank 0)"
            )
    if fmt != "full":
        return
    optimizer = torch.load(run.out / "raw_optimizer.pt", weights_only=False)
    _assert_equal_nested(optimizer["loaded"], optimizer["saved"], "optimizer")
    head = ["net.head.bias", "net.head.weight"]
    for rank in (0, 1):
        raw = run.rank(rank)["raw"]
        assert raw["filtered_keys"] == head  # fabric.save(filter={"model": ...}) kept only what the filter accepts
        assert raw["strict_error"].startswith(f"CheckpointError: Cannot load checkpoint '{run.out / 'filtered.ckpt'}'")
        assert "it was written for another model: missing 12 parameter(s) of this model" in raw["strict_error"]
    # strict=False: the filtered entries loaded, the others kept their values
    partial = run.rank(0)["raw"]["partial"]
    assert {k for k, v in partial.items() if v == "trained"} == {"head.bias", "head.weight"}
    assert {v for k, v in partial.items() if not k.startswith("head.")} == {"kept"}


@pytest.mark.slow
def test_a_background_save_still_writing_when_the_script_ends_is_committed_at_exit(scenario, tmp_path):
    """No teardown: the last fabric.save (a 2 s write) is still in flight when the script returns; the interpreter's
    exit (atexit) waits for it, so the checkpoint is committed, and then closes the heartbeat, the background group and
    the process group: the script exits 0 with nothing of the package left running."""
    ckpt = tmp_path / "ckpt"
    run = scenario(
        {
            "strategy": {**_strategy(1, "sharded"), "async_save": True},
            "epochs": 2,
            "save": str(ckpt),
            "save_after_epoch": 2,
            "slow_writes": 2.0,
            "exit_normally": True,
            "late_collective": True,
        },
        script=FABRIC,
        expect_ok=False,
        launcher="lightning",  # the pool ends its ranks with os._exit, which skips atexit
    )
    for rank in (0, 1):
        assert run.rank(rank)["save"]["in_flight"]
    assert describe(ckpt)["global_step"] == 6, run.proc.stderr[-3000:]
    assert "terminate called" not in run.proc.stderr, run.proc.stderr[-3000:]
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((run.out / f"exit{rank}.json").read_text()) == {"process_group": False, "threads": []}


@pytest.mark.versions
@pytest.mark.parametrize(("engine", "fmt"), [(1, "sharded"), (2, "full")])
def test_checkpoints_cross_between_the_trainer_and_fabric(scenario, tmp_path, engine, fmt):
    """A checkpoint of the Trainer's strategy loads in Fabric (model, optimizer, its scheduler from
    ``lr_schedulers``, ``global_step``), and one Fabric saved (in Fabric's layout) resumes a Trainer."""
    strategy = _strategy(engine, fmt)
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


def test_hand_wrapped_transformers_model_trains_without_its_kv_cache_under_activation_checkpointing(scenario):
    """Layers wrapped by hand under fabric.init_module(), activation checkpointing from the strategy: as through the
    Trainer's door, a training forward builds no KV cache although config.use_cache is on (on transformers 4.x a cache
    makes the recomputation fail with CheckpointError); evaluation keeps it. The embeddings, the final norm and
    ``lm_head``, outside the user's units, go into the root unit: 2 ranks equal one process on the global batch."""
    pytest.importorskip("transformers")
    run = scenario({}, script="fabric_hand_wrapped.py")
    final = run.final()
    reference = final["reference"]
    assert run.rank(0)["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert final["weights"].keys() == reference["weights"].keys()
    for key, value in reference["weights"].items():
        torch.testing.assert_close(final["weights"][key], value, atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    plain = torch.load(run.out / "replicated0.pt", weights_only=True)
    assert plain  # the rotary embedding's buffers, and nothing else
    assert all(name.endswith("inv_freq") for name in plain), sorted(plain)
    for r in (0, 1):
        info = run.rank(r)
        assert info["use_cache"] is True
        assert info["checkpoint_wrappers"] == 2  # both decoder layers are recomputed in backward
        assert info["cache_in_training"] == [False, False]
        assert info["cache_in_evaluation"] is True
        assert all(math.isfinite(loss) for loss in info["losses"])
    output = run.proc.stdout + run.proc.stderr
    assert re.search(r"KV cache in training +: off in <root>, model \(activation checkpointing\)", output)
