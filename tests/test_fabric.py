"""Fabric's GaudiFSDPStrategy in one process: the same arguments and refusals as the Trainer's, the registries, the
precision plugin, and the Gaudi path against the habana_frameworks test double."""

from __future__ import annotations

import inspect
import pydoc
import typing

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from lightning_gaudi_fsdp import GaudiFSDPStrategy as TrainerStrategy
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy
from lightning_gaudi_fsdp.precision import GaudiFabricFSDPPrecision


def _own(door: type) -> tuple[str, ...]:
    """The arguments a door takes for Lightning's plugins (not FSDP's): the Trainer's and Fabric's differ."""
    if door is TrainerStrategy:
        return ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")
    return ("accelerator", "parallel_devices", "cluster_environment", "precision")


def test_both_doors_name_and_type_every_argument_from_one_definition():
    from lightning_gaudi_fsdp._config import resolve

    shared = inspect.signature(resolve).parameters
    for door in (TrainerStrategy, GaudiFSDPStrategy):
        parameters = inspect.signature(door).parameters
        assert list(parameters) == [*_own(door), *shared], door  # no **kwargs: help(), IDEs and YAML see each one
        for name in shared:
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
            assert parameters[name].annotation == typing.get_type_hints(resolve)[name], (door, name)
            assert not isinstance(parameters[name].annotation, str)  # evaluated: jsonargparse reads it as is
    text = pydoc.render_doc(GaudiFSDPStrategy)
    assert "sharding_strategy: str | torch.distributed.fsdp." in text
    assert "ShardingStrategy = 'FULL_SHARD'" in text
    assert "state_dict_type: str = 'sharded'" in text
    with pytest.raises(TypeError, match=r"GaudiFSDPStrategy got unexpected keyword argument\(s\) \['shard'\]"):
        GaudiFSDPStrategy(shard="FULL")
    with pytest.raises(TypeError, match=r"GaudiFSDPStrategy got unexpected keyword argument\(s\) \['shard'\]"):
        TrainerStrategy(shard="FULL")
    assert GaudiFSDPStrategy()._background is None
    saver = GaudiFSDPStrategy(async_save=True, timeout=30)._background
    assert saver is not None
    assert saver.active  # every fabric.save goes to the background (no fit to wait for)


def _effective(strategy: object, name: str) -> object:
    """What a strategy does with argument ``name`` when it is not given (Lightning's attributes, on both doors)."""
    kwargs = strategy.kwargs if hasattr(strategy, "kwargs") else strategy._fsdp_kwargs
    attribute = {
        "process_group_backend": "_process_group_backend",
        "timeout": "_timeout",
        "state_dict_type": "_state_dict_type",
        "activation_checkpointing_policy": "_activation_checkpointing_kwargs",
    }.get(name)
    if name == "device_mesh":  # Lightning keeps it with the FSDP arguments; the package builds it on its device
        return getattr(strategy, "_device_mesh", kwargs.get("device_mesh"))
    if attribute is not None:
        return getattr(strategy, attribute)
    if name in ("cpu_offload", "mixed_precision", "sharding_strategy"):
        return getattr(strategy, name)
    return kwargs.get(name, inspect.signature(FSDP).parameters[name].default)  # passed on to FSDP as given


@pytest.mark.parametrize("door", [TrainerStrategy, GaudiFSDPStrategy], ids=["trainer", "fabric"])
def test_defaults_are_those_of_lightnings_fsdp_strategy_for_the_same_door(door):
    from lightning.fabric.strategies import FSDPStrategy as LightningFabric
    from lightning.pytorch.strategies import FSDPStrategy as LightningTrainer

    lightning_door = LightningTrainer if door is TrainerStrategy else LightningFabric
    named = [n for n, p in inspect.signature(lightning_door).parameters.items() if p.kind is not p.VAR_KEYWORD]
    fsdp = [n for n in inspect.signature(FSDP).parameters if n not in ("self", "module", "device_id")]
    ours = inspect.signature(door).parameters
    shared = [n for n in dict.fromkeys(named + fsdp) if n in ours and n not in _own(door)]
    assert len(shared) >= 15  # Lightning's named arguments and those it passes on to FSDP
    mine, theirs = door(), lightning_door()
    differ = {n: (_effective(mine, n), _effective(theirs, n)) for n in shared}
    assert {n: pair for n, pair in differ.items() if pair[0] != pair[1]} == {}
    assert mine._state_dict_type == ("full" if door is TrainerStrategy else "sharded")


def test_fabric_arguments_from_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()  # what LightningCLI (or a script's own jsonargparse config) builds
    parser.add_class_arguments(GaudiFSDPStrategy, "strategy")
    config = parser.parse_string("strategy:\n  state_dict_type: full\n  sharding_strategy: SHARD_GRAD_OP\n")
    assert config.strategy.fsdp_version == 1  # the definition's defaults, read from the signature
    strategy = GaudiFSDPStrategy(**config.strategy.as_dict())
    assert strategy._state_dict_type == "full"
    assert strategy.sharding_strategy.name == "SHARD_GRAD_OP"
    assert parser.get_defaults().strategy.state_dict_type == "sharded"


def test_the_engine_is_selected_once_per_strategy(monkeypatch):
    from lightning_gaudi_fsdp.engine import base

    chosen = []
    select = base.select
    monkeypatch.setattr(base, "select", lambda version: chosen.append(version) or select(version))
    for door in (TrainerStrategy, GaudiFSDPStrategy):
        chosen.clear()
        strategy = door()
        assert len(chosen) == 1, door
        assert strategy._engine is strategy._config.engine


BAD = [
    {"sharding_strategy": "QUARTER_SHARD"},
    {"state_dict_type": "zip"},
    {"fsdp_version": 3},
    {"backward_prefetch": "SIDEWAYS"},
    {"device_mesh": [2, 2]},  # needs hybrid sharding
    {"sharding_strategy": "HYBRID_SHARD"},  # needs a wrap policy, process group or mesh
    {"ignored_modules": ["a"], "ignored_states": ["b"]},
    {"mixed_precision": {"param_dtype": "float7"}},
    {"auto_wrap_policy": "no.such.Module"},
    {"use_orig_params": "maybe"},
    {"timeout": -5},
    {"compile": "yes please"},
    {"state_dict_type": "local", "sharding_strategy": "NO_SHARD"},
    {"fsdp_version": 2, "backward_prefetch": "BACKWARD_POST"},
    {"fsdp_version": 2, "use_orig_params": False},
    {"async_save": "later"},
    {"preemption": "later"},
    {"preemption_grace": 0},
]


@pytest.mark.parametrize("kwargs", BAD, ids=[",".join(k) for k in BAD])
def test_bad_arguments_fail_with_the_trainer_strategy_message(kwargs):
    with pytest.raises((ValueError, TypeError, RuntimeError)) as trainer_error:
        TrainerStrategy(**kwargs)
    with pytest.raises(type(trainer_error.value)) as fabric_error:
        GaudiFSDPStrategy(**kwargs)
    assert str(fabric_error.value) == str(trainer_error.value)


def test_names_and_hpu_are_registered_for_fabric():
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert "hpu" in ACCELERATOR_REGISTRY
    for name in ("gaudi_fsdp", "hpu_fsdp"):
        assert STRATEGY_REGISTRY[name]["strategy"] is GaudiFSDPStrategy
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="hpu_fsdp")
    assert type(fabric.strategy) is GaudiFSDPStrategy


def test_fabric_precision_autocasts_on_the_device_in_use():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=GaudiFSDPStrategy(), precision="bf16-mixed")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, GaudiFabricFSDPPrecision)
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="works with FSDP precision plugins only"):
        fabric.strategy.precision = object()


# the hpu checks of both doors (hccl, device, environment, autocast, refusals): test_gaudi.py


def test_restoring_state_entries_in_place():
    from lightning_gaudi_fsdp.fabric import FABRIC_KEYS, _restore_entries

    def scheduler() -> torch.optim.lr_scheduler.StepLR:
        return torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), 2)

    saved = scheduler()
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    # a Fabric checkpoint: entries by name, internal keys dropped from what is returned
    sched = scheduler()
    state = {"model": None, "scheduler": sched, "step": 0}
    rest = {"scheduler": saved.state_dict(), "step": 3, "extra": 1, FABRIC_KEYS: {}, "lr_schedulers": []}
    assert _restore_entries(state, rest, "model", {}, strict=True) == {"extra": 1}
    assert state["scheduler"] is sched
    assert sched.last_epoch == 3
    assert state["step"] == 3
    # a Trainer checkpoint: schedulers from lr_schedulers in order, other entries by name
    sched = scheduler()
    state = {"model": None, "scheduler": sched, "global_step": 0}
    trainer = {"lr_schedulers": [saved.state_dict()], "global_step": 3, "epoch": 1, "pytorch-lightning_version": "x"}
    assert _restore_entries(state, trainer, "model", {}, strict=True) == {"epoch": 1}
    assert state["scheduler"] is sched
    assert sched.last_epoch == 3
    assert state["global_step"] == 3
    # strict: every requested entry must be there
    with pytest.raises(KeyError, match="The requested state contains a key 'tokens' that does not exist"):
        _restore_entries({"model": None, "tokens": 0}, {"step": 1}, "model", {}, strict=True)
    state = {"model": None, "tokens": 5}
    assert _restore_entries(state, {"step": 1}, "model", {}, strict=False) == {"step": 1}
    assert state["tokens"] == 5


@pytest.mark.parametrize("fmt", ["sharded", "local"])
def test_save_filter_is_refused_before_anything_is_written_except_for_full(tmp_path, fmt):
    model = torch.nn.Linear(2, 2)
    strategy = GaudiFSDPStrategy(state_dict_type=fmt)
    path = tmp_path / "ckpt"
    with pytest.raises(
        ValueError,
        match=rf"fabric.save\(filter=...\) needs state_dict_type='full'; this strategy "
        rf"writes '{fmt}' checkpoints",
    ):
        strategy.save_checkpoint(path, {"model": model}, filter={"model": lambda k, v: True})
    assert not path.exists()
    full = GaudiFSDPStrategy(state_dict_type="full")
    with pytest.raises(ValueError, match=r"filter key 'optimiser' is not in the state; expected one of \['model'\]"):
        full.save_checkpoint(path, {"model": model}, filter={"optimiser": lambda k, v: True})
    with pytest.raises(TypeError, match=r"filter\['model'\] must be a \(name, value\) -> bool function, got 1"):
        full.save_checkpoint(path, {"model": model}, filter={"model": 1})


def test_save_refuses_a_state_entry_named_like_the_bookkeeping(tmp_path):
    """The package's bookkeeping sits under one key of Fabric's layout: a user's entry may not take it (nor the
    Trainer's names, which the readers take for the Trainer's layout)."""
    path = tmp_path / "ckpt"
    for key in ("gaudi_fsdp", "state_dict"):
        with pytest.raises(ValueError, match=rf"state keys \['{key}'\] are reserved for the checkpoint's bookkeeping"):
            GaudiFSDPStrategy().save_checkpoint(path, {"model": torch.nn.Linear(2, 2), key: 1})
    assert not path.exists()


@pytest.mark.fsdp2
def test_fsdp2_refuses_an_optimizer_made_before_the_model_is_sharded():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="with fsdp_version=2, set up the model first"):
        GaudiFSDPStrategy(fsdp_version=2).setup_module_and_optimizers(model, [optimizer])
