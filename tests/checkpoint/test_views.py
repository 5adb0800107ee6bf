"""Checkpoint layouts read offline (``inspect``, ``convert``): Lightning's own Fabric layout, this package's Fabric
layout and files of the previous release, whose Fabric door wrote the Trainer's layout. The files are made by hand,
each as its writer's source builds it; the launched round trips are in ``tests/distributed/test_fabric.py``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateKeyType

from lightning_gaudi_fsdp.checkpoint.convert import convert, describe, load_full_state
from lightning_gaudi_fsdp.checkpoint.formats import ENGINE_KEY, PARAM_ID_NAMES_KEY, CheckpointError
from lightning_gaudi_fsdp.checkpoint.loading import read_full_model_state, read_full_optimizer_state
from lightning_gaudi_fsdp.cli import main


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _lightning_fabric_file(path, model, optimizer, scheduler) -> None:
    """What Lightning's Fabric ``FSDPStrategy.save_checkpoint`` writes with ``state_dict_type="full"``: each entry of
    ``state`` under its key, the optimizer as ``FSDP.optim_state_dict`` gives it (keyed by parameter name)."""
    by_name = FSDP.rekey_optim_state_dict(optimizer.state_dict(), OptimStateKeyType.PARAM_NAME, model)
    state = {"model": model.state_dict(), "optimizer": by_name, "scheduler": scheduler.state_dict(), "step": 2}
    torch.save(state, path)


def _previous_release_file(path, model, optimizer, scheduler) -> None:
    """What this package's Fabric door wrote before Fabric's layout: the Trainer's layout plus where each entry went."""
    torch.save(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [optimizer.state_dict()],  # keyed by parameter id
            "lr_schedulers": [scheduler.state_dict()],
            "pytorch-lightning_version": "2.6.6",
            "scheduler": scheduler.state_dict(),
            "step": 2,
            "gaudi_fsdp_fabric_keys": {"model": "model", "optimizers": ["optimizer"], "schedulers": ["scheduler"]},
            ENGINE_KEY: 1,
            PARAM_ID_NAMES_KEY: [name for name, _ in model.named_parameters()],
        },
        path,
    )


@pytest.mark.parametrize("writer", [_lightning_fabric_file, _previous_release_file])
def test_fabric_checkpoints_inspect_and_convert_in_fabric_layout(tmp_path, writer):
    """Both convert to full in Fabric's layout (the previous release's file too): entries of the saved state at the
    top level, the optimizer keyed by name, the bookkeeping under one key; to sharded with the state's keys as DCP
    keys; and back. ``inspect`` says which layout it read."""
    model, optimizer, scheduler = _trained()
    src = tmp_path / "src.ckpt"
    writer(src, model, optimizer, scheduler)
    info = describe(src)
    assert info["layout"] == "fabric"
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["optimizer"] is True
    out = tmp_path / "full.ckpt"
    assert main(["convert", str(src), str(out), "--to", "full"]) == 0
    converted = torch.load(out, weights_only=True)
    assert list(converted)[:2] == ["model", "optimizer"]
    assert {"scheduler", "step", "gaudi_fsdp"} <= set(converted)
    assert not {"state_dict", "optimizer_states", "lr_schedulers", "gaudi_fsdp_fabric_keys"} & set(converted)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    plain.load_state_dict(converted["model"], strict=True)
    x = torch.randn(2, 4)
    assert torch.equal(plain(x), model(x))
    expected = FSDP.rekey_optim_state_dict(optimizer.state_dict(), OptimStateKeyType.PARAM_NAME, model)
    torch.testing.assert_close(converted["optimizer"]["state"], expected["state"], atol=0, rtol=0)
    for group, want in zip(converted["optimizer"]["param_groups"], expected["param_groups"], strict=True):
        assert {**group, "params": sorted(group["params"])} == {**want, "params": sorted(want["params"])}
    assert converted["scheduler"] == scheduler.state_dict()
    # to sharded: Lightning's Fabric sharded layout (DCP keys are the state's keys), and back to the same file
    sharded = tmp_path / "sharded"
    convert(out, sharded, "sharded")
    assert describe(sharded)["layout"] == "fabric"
    from torch.distributed.checkpoint import FileSystemReader

    tops = {key.split(".", 1)[0] for key in FileSystemReader(str(sharded)).read_metadata().state_dict_metadata}
    assert tops == {"model", "optimizer"}
    meta = torch.load(sharded / "meta.pt", weights_only=True)
    assert set(meta) == {"scheduler", "step", "gaudi_fsdp"}
    again = tmp_path / "again.ckpt"
    convert(sharded, again, "full")
    back = torch.load(again, weights_only=True)
    torch.testing.assert_close(back["model"], converted["model"], atol=0, rtol=0)
    torch.testing.assert_close(back["optimizer"]["state"], converted["optimizer"]["state"], atol=0, rtol=0)
    assert back["scheduler"] == converted["scheduler"]
    # the readers fabric.load_raw uses: the model and the one optimizer, from either layout
    for path in (src, out):
        torch.testing.assert_close(read_full_model_state(path), model.state_dict(), atol=0, rtol=0)
        assert read_full_optimizer_state(path)["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"]


def test_a_trainer_checkpoint_converts_in_the_trainer_layout(tmp_path):
    model, optimizer, scheduler = _trained()
    src = tmp_path / "trainer.ckpt"
    torch.save(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [optimizer.state_dict()],
            "lr_schedulers": [scheduler.state_dict()],
            "pytorch-lightning_version": "2.6.6",
            "global_step": 2,
        },
        src,
    )
    assert describe(src)["layout"] == "trainer"
    out = tmp_path / "full.ckpt"
    convert(src, out, "full")
    assert set(torch.load(out, weights_only=True)) == {
        "state_dict",
        "optimizer_states",
        "lr_schedulers",
        "pytorch-lightning_version",
        "global_step",
    }


def test_a_file_of_no_known_layout_is_refused_naming_what_it_lacks(tmp_path):
    path = tmp_path / "odd.ckpt"
    torch.save({"weights": torch.ones(2), "step": 1}, path)
    with pytest.raises(CheckpointError, match="it has no 'state_dict' entry; it is not a Lightning checkpoint"):
        load_full_state(path)
    torch.save({"step": 1, "note": "no model"}, path)
    with pytest.raises(CheckpointError, match="it has no 'state_dict' entry; it is not a Lightning checkpoint"):
        describe(path)


def test_a_sharded_checkpoint_of_lightning_fabric_inspects_and_converts(tmp_path):
    """Lightning's Fabric sharded layout, made by hand as its ``save_checkpoint`` does: the model and optimizer in DCP
    under their keys of ``state`` (here ``net`` and ``opt``, not the Trainer's ``model``/``optimizer_0``), the other
    entries in ``meta.pt``."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, scheduler = _trained()
    src = tmp_path / "lightning-sharded"
    by_name = FSDP.rekey_optim_state_dict(optimizer.state_dict(), OptimStateKeyType.PARAM_NAME, model)
    dcp.save({"net": model.state_dict(), "opt": by_name}, checkpoint_id=src, no_dist=True)
    torch.save({"scheduler": scheduler.state_dict(), "step": 2}, src / "meta.pt")
    info = describe(src)
    assert (info["format"], info["layout"], info["optimizer"]) == ("sharded", "fabric", True)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    out = tmp_path / "full.ckpt"
    convert(src, out, "full")
    converted = torch.load(out, weights_only=True)
    assert list(converted) == ["net", "opt", "scheduler", "step", "gaudi_fsdp"]
    torch.testing.assert_close(converted["net"], model.state_dict(), atol=0, rtol=0)
    torch.testing.assert_close(converted["opt"]["state"], by_name["state"], atol=0, rtol=0)
