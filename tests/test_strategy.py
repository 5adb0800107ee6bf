"""Constructing the strategy: validation before any process starts, registration, Trainer integration."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from helpers import slurm_environment
from lightning_gaudi_fsdp import GaudiAccelerator, GaudiFSDPPrecision, GaudiFSDPStrategy
from lightning_gaudi_fsdp.fabric import GaudiFSDPStrategy as FabricStrategy

pytestmark = pytest.mark.versions  # also run on the older torch/Lightning pairings in CI


def test_defaults_are_resolved_without_touching_devices():
    strategy = GaudiFSDPStrategy()
    assert strategy.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert strategy.kwargs["backward_prefetch"] is BackwardPrefetch.BACKWARD_PRE
    assert strategy.kwargs["use_orig_params"] is True
    assert strategy.kwargs["limit_all_gathers"] is True
    assert strategy._config.state_dict_type == "full"
    assert strategy._config.check_free_space is None  # the environment decides, at each save
    assert strategy.parallel_devices is None  # nothing probed at construction


def test_every_argument_is_documented_and_resolved_into_one_option_object():
    """Adding an argument touches its parameter and docstring line, ``Resolved`` and its resolver, and the code that
    acts on it (docs/architecture.md): the code acts on ``door._config``, so every argument must land there."""
    import dataclasses
    import inspect
    import re

    from lightning_gaudi_fsdp import _config

    arguments = list(inspect.signature(_config.resolve).parameters)
    documented = set(re.findall(r"^        (\w+): ", GaudiFSDPStrategy.__doc__, re.MULTILINE))
    assert [name for name in arguments if name not in documented] == []
    fields = {field.name for field in dataclasses.fields(_config.Resolved)}
    # Arguments resolved into a field of another name (the form the code uses):
    renamed = {
        "activation_checkpointing_policy": "activation_checkpointing_kwargs",
        "compile": "compile_kwargs",
        "fsdp_version": "engine",
        "pretrained_weights": "pretrained",
        "pretrained_prefix": "pretrained",
    }
    assert [name for name in arguments if renamed.get(name, name) not in fields] == []
    for name in ("Trainer", "Fabric"):
        door = GaudiFSDPStrategy if name == "Trainer" else FabricStrategy
        assert set(arguments) <= set(inspect.signature(door).parameters), name


def test_yaml_spellings_become_torch_objects():
    strategy = GaudiFSDPStrategy(
        sharding_strategy="shard_grad_op",
        auto_wrap_policy=["torch.nn.Linear"],
        backward_prefetch="backward_post",
        mixed_precision={"param_dtype": "bf16"},
        state_dict_type="SHARDED",
        timeout=30,
        param_init_fn="torch.nn.init.zeros_",
    )
    assert strategy.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert isinstance(strategy.kwargs["auto_wrap_policy"], ModuleWrapPolicy)
    assert strategy.kwargs["backward_prefetch"] is BackwardPrefetch.BACKWARD_POST
    assert strategy.mixed_precision.param_dtype is torch.bfloat16
    assert strategy._config.state_dict_type == strategy._state_dict_type == "sharded"  # Lightning's copy agrees
    assert strategy._config.timeout == strategy._timeout == timedelta(seconds=30)
    assert strategy._config.auto_wrap_policy is strategy.kwargs["auto_wrap_policy"]
    assert strategy._config.param_init_fn is torch.nn.init.zeros_
    assert strategy.kwargs["param_init_fn"] is torch.nn.init.zeros_


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding_strategy": "FULL"}, ValueError, "sharding_strategy='FULL' is not supported; expected one of"),
        ({"state_dict_type": "dcp"}, ValueError, "state_dict_type='dcp' is not supported; expected one of 'full'"),
        ({"sharding_strategy": "HYBRID_SHARD"}, ValueError, "needs at least one of auto_wrap_policy"),
        ({"state_dict_type": "local", "sharding_strategy": "NO_SHARD"}, ValueError, "needs a sharded strategy"),
        (
            {"state_dict_type": "local", "sharding_strategy": "HYBRID_SHARD", "device_mesh": [1, 2]},
            ValueError,
            "cannot be used with a device_mesh",
        ),
        (
            {"process_group_backend": "nccl2"},
            ValueError,
            "process_group_backend='nccl2' is not supported; expected one of 'hccl', 'gloo', 'nccl', 'mpi' or None",
        ),
        ({"timeout": -1}, ValueError, "timeout=-1 is not supported; expected a timedelta or a positive number"),
        ({"device_id": -1}, ValueError, "device_id=-1 is not supported"),
        ({"device_id": "gpu7"}, ValueError, "device_id='gpu7' is not a device"),
        ({"sync_module_states": "yes"}, TypeError, "sync_module_states must be True or False, got str 'yes'"),
        ({"forward_prefetch": 1}, TypeError, "forward_prefetch must be True or False, got int 1"),
        ({"limit_all_gathers": None}, TypeError, "limit_all_gathers must be True or False"),
        ({"use_orig_params": "false"}, TypeError, "use_orig_params must be True or False"),
        ({"eager_pipeline": "false"}, TypeError, "eager_pipeline must be True or False"),
        ({"param_init_fn": 3}, TypeError, "param_init_fn must be a callable or None, got int 3"),
        ({"ignored_modules": ["a"], "ignored_states": ["b"]}, ValueError, "mutually exclusive"),
        ({"ignored_modules": 5}, TypeError, "ignored_modules must be a list of module names or objects, got int 5"),
        ({"compile": "inductor"}, TypeError, "compile must be True, False or a dict"),
        ({"auto_wrap_policy": "mymodel.Layer"}, ValueError, "auto_wrap_policy: cannot import module 'mymodel'"),
        ({"activation_checkpointing_policy": 3}, TypeError, "activation_checkpointing_policy must be module classes"),
        ({"mixed_precision": {"param_dtype": "bfloat8"}}, ValueError, r"mixed_precision\['param_dtype'\]='bfloat8'"),
        ({"device_mesh": [2, 2]}, ValueError, "only applies to hybrid sharding"),
        ({"cpu_offload": "no"}, TypeError, "cpu_offload must be True or False, got str 'no'"),
        ({"check_free_space": "no"}, TypeError, "check_free_space must be True or False, got str 'no'"),
        ({"checkpoint_crc32": "yes"}, TypeError, "checkpoint_crc32 must be True or False, got str 'yes'"),
        ({"async_save": "true"}, TypeError, "async_save must be True or False, got str 'true'"),
        ({"async_save": 1}, TypeError, "async_save must be True or False, got int 1"),
        ({"preemption": "kill"}, ValueError, "preemption='kill' is not supported; expected one of 'save', 'exit'"),
        ({"preemption": None}, ValueError, "preemption=None is not supported; expected one of 'save', 'exit'"),
        (
            {"preemption_grace": 0.5},
            ValueError,
            "preemption_grace=0.5 is not supported; expected a number of seconds above 1 and at most 3600",
        ),
        ({"preemption_grace": "25s"}, ValueError, "preemption_grace='25s' is not supported"),
    ],
)
def test_bad_values_fail_at_construction_with_the_argument_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        GaudiFSDPStrategy(**kwargs)


@pytest.mark.parametrize("door", [GaudiFSDPStrategy, FabricStrategy])
def test_checkpoint_crc32_is_deprecated_in_favour_of_verify_checkpoints_and_still_writes_the_crc32s(door, recwarn):
    from lightning.fabric.utilities.rank_zero import LightningDeprecationWarning

    door(checkpoint_crc32=False)
    door()
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    with pytest.warns(LightningDeprecationWarning) as caught:
        strategy = door(checkpoint_crc32=True)
    message = str(caught[0].message)
    assert message.startswith("checkpoint_crc32 is deprecated: the checksums verify_checkpoints=True records"), message
    assert "still writes them for zip tools" in message
    assert strategy._config.checkpoint_crc32 is True


def test_preemption_saves_by_default_with_a_25_s_grace_on_both_doors_and_from_yaml():
    from datetime import timedelta

    from jsonargparse import ArgumentParser

    from lightning_gaudi_fsdp import fabric

    strategy = GaudiFSDPStrategy()
    assert (strategy._config.preemption, strategy._config.preemption_grace) == ("save", 25.0)
    strategy = fabric.GaudiFSDPStrategy(preemption="EXIT", preemption_grace=timedelta(seconds=50))
    assert (strategy._config.preemption, strategy._config.preemption_grace) == ("exit", 50.0)
    parser = ArgumentParser()  # LightningCLI's parser
    parser.add_class_arguments(GaudiFSDPStrategy, "strategy")
    config = parser.parse_string("strategy:\n  preemption: exit\n  preemption_grace: 12\n")
    strategy = GaudiFSDPStrategy(**config.strategy.as_dict())
    assert (strategy._config.preemption, strategy._config.preemption_grace) == ("exit", 12.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fsdp_version": 3}, "fsdp_version=3 is not supported; expected one of '1', '2'"),
        (
            {"mixed_precision": {"output_dtype": "bf16"}},
            r"mixed_precision\['output_dtype'\]='bf16' needs fsdp_version=2",
        ),
    ],
)
def test_engine_choice_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GaudiFSDPStrategy(**kwargs)


@pytest.mark.fsdp2
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sharding_strategy": "NO_SHARD"}, "sharding_strategy='NO_SHARD' is not supported with fsdp_version=2"),
        ({"process_group": object()}, "process_group is not supported with fsdp_version=2: fully_shard takes a device"),
        (
            {"backward_prefetch": "backward_post"},
            "backward_prefetch='BACKWARD_POST' is not supported with fsdp_version=2",
        ),
        ({"backward_prefetch": None}, "backward_prefetch=None is not supported with fsdp_version=2: FSDP2 always"),
        ({"limit_all_gathers": False}, "limit_all_gathers=False is not supported with fsdp_version=2"),
        ({"use_orig_params": False}, "use_orig_params=False is not supported with fsdp_version=2"),
        ({"mixed_precision": {"buffer_dtype": "bf16"}}, r"mixed_precision\['buffer_dtype'\]='bf16' is not supported"),
        (
            {"mixed_precision": {"keep_low_precision_grads": True}},
            r"mixed_precision\['keep_low_precision_grads'\]=True is not supported with fsdp_version=2",
        ),
    ],
)
def test_fsdp1_values_without_an_fsdp2_meaning_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GaudiFSDPStrategy(fsdp_version=2, **kwargs)


@pytest.mark.fsdp2
def test_fsdp2_mixed_precision_becomes_a_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    strategy = GaudiFSDPStrategy(
        fsdp_version="2", mixed_precision={"param_dtype": "bf16", "reduce_dtype": "float32", "output_dtype": "fp32"}
    )
    assert strategy._config.engine.version == 2
    assert strategy._config.mp_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32, cast_forward_inputs=True
    )
    assert strategy._config.keep_batch_dtypes  # the root leaves the batch alone, as with FSDP1
    assert strategy.mixed_precision is None  # no FSDP1 MixedPrecision is built


def test_the_heartbeat_switch_is_an_option_read_where_the_strategy_is_built(monkeypatch):
    from lightning_gaudi_fsdp import _liveness

    monkeypatch.setenv("LIGHTNING_GAUDI_FSDP_HEARTBEAT", "0")
    off = GaudiFSDPStrategy()
    monkeypatch.delenv("LIGHTNING_GAUDI_FSDP_HEARTBEAT")
    assert (off._config.heartbeat, GaudiFSDPStrategy()._config.heartbeat) == (False, True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    # what after_process_group hands the heartbeat (and preemption="save" checks): off, whatever the environment now
    assert not _liveness.Heartbeat(0, 2, "node", enabled=off._config.heartbeat).available()
    assert _liveness.Heartbeat(0, 2, "node").available()


def test_async_save_is_off_by_default_and_goes_to_the_background_only_while_fit_trains():
    assert GaudiFSDPStrategy()._background is None
    strategy = GaudiFSDPStrategy(async_save=True, timeout=30, state_dict_type="full")  # every format may save async
    saver = strategy._background
    assert saver is not None
    assert saver._timeout == timedelta(seconds=30)  # the background group's timeout is the strategy's
    assert not saver.active  # saves before the training loop starts (and after teardown) stay synchronous
    strategy.on_train_start()
    assert saver.active


def test_async_save_from_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(GaudiFSDPStrategy, "strategy")
    config = parser.parse_string("strategy:\n  async_save: true\n  state_dict_type: sharded\n")
    strategy = GaudiFSDPStrategy(**config.strategy.as_dict())
    assert strategy._background is not None


def test_registered_names_build_our_strategy():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="gaudi_fsdp", logger=False)
    assert type(trainer.strategy) is GaudiFSDPStrategy
    assert isinstance(trainer.strategy.precision_plugin, GaudiFSDPPrecision)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="hpu_fsdp", logger=False)
    assert type(trainer.strategy) is GaudiFSDPStrategy


def test_registration_is_idempotent():
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_gaudi_fsdp

    lightning_gaudi_fsdp.register()
    lightning_gaudi_fsdp.register()
    assert AcceleratorRegistry["hpu"]["accelerator"] is GaudiAccelerator
    assert StrategyRegistry["gaudi_fsdp"]["strategy"] is GaudiFSDPStrategy


def test_hpu_without_gaudi_says_not_available():
    with pytest.raises(Exception, match="not available") as info:
        L.Trainer(accelerator="hpu", devices=1, strategy=GaudiFSDPStrategy(), logger=False)
    assert "invalid accelerator name" not in str(info.value).lower()


def test_trainer_precision_is_kept_and_autocasts_on_the_device_type():
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=GaudiFSDPStrategy(), precision="bf16-mixed", logger=False
    )
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, GaudiFSDPPrecision)
    assert plugin.precision == "bf16-mixed"
    plugin.set_device_type("cpu")
    with plugin.forward_context():
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert out.dtype is torch.bfloat16


@pytest.mark.parametrize("engine", [1, pytest.param(2, marks=pytest.mark.fsdp2)])
def test_mixed_precision_with_a_trainer_precision_warns_on_both_engines(engine):
    strategy = GaudiFSDPStrategy(fsdp_version=engine, mixed_precision={"param_dtype": "bf16"})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", logger=False)
    expected = (
        "GaudiFSDPStrategy(mixed_precision=...) sets FSDP's parameter/reduce/buffer dtypes and overrides the dtypes "
        "Trainer(precision='bf16-mixed') would choose for them; autocast and input casting still follow the "
        "Trainer's precision."
    )
    # The Trainer's setup hands the model to _setup_model, which warns before sharding; the sharding itself needs the
    # process group of a launched run (a scenario's), absent here, and fails after the warning.
    warns = pytest.warns(UserWarning, match="overrides the dtypes")
    with warns as record, contextlib.suppress(RuntimeError, ValueError):
        trainer.strategy._setup_model(torch.nn.Linear(2, 2))
    assert [str(w.message) for w in record if "overrides the dtypes" in str(w.message)] == [expected]


def test_16_mixed_scaler_targets_the_device_in_use():
    plugin = GaudiFSDPPrecision("16-mixed")
    plugin.set_device_type("cpu")
    assert plugin.scaler is not None
    assert plugin.scaler._device == "cpu"


def test_a_scaler_the_user_passes_is_kept():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mine = ShardedGradScaler(device="cpu", init_scale=1024.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=GaudiFSDPStrategy(), plugins=[GaudiFSDPPrecision("16-mixed", mine)]
    )
    plugin = trainer.strategy.precision_plugin
    plugin.set_device_type("cpu")
    assert plugin.scaler is mine
    assert plugin.scaler.get_scale() == 1024.0
    with pytest.raises(ValueError, match="`precision='bf16-mixed'` does not use a scaler"):
        GaudiFSDPPrecision("bf16-mixed", mine)


def test_hccl_on_cpu_is_refused_before_processes_start():
    strategy = GaudiFSDPStrategy(process_group_backend="hccl")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    with pytest.raises(ValueError, match="process_group_backend='hccl' needs accelerator='hpu'; this run uses 'cpu'"):
        trainer.strategy._get_process_group_backend()


def test_default_backend_on_cpu_is_gloo():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=GaudiFSDPStrategy(), logger=False)
    assert trainer.strategy._get_process_group_backend() == "gloo"


def test_device_mesh_that_does_not_match_the_world_size_fails_before_launch():
    strategy = GaudiFSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=[2, 4])
    with pytest.raises(ValueError, match=r"device_mesh=\[2, 4\] has 8 devices but the world size is 2"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)


def test_trainer_weights_only_is_read_from_the_running_trainer_call():
    """Lightning 2.6 drops ``fit(..., weights_only=...)`` for strategies that restore after setup (FSDP); the strategy
    reads it from ``Trainer._run``'s frame. This pins the shape that relies on."""
    import inspect

    from lightning_gaudi_fsdp.adapters.lightning_internals import fit_weights_only

    trainer = object()

    def _run(self: object, weights_only: bool | None) -> bool | None:  # the shape of Trainer._run
        return fit_weights_only(trainer)

    assert _run(trainer, False) is False
    assert _run(trainer, None) is None
    assert _run(object(), False) is None  # another Trainer's call
    assert fit_weights_only(trainer) is None
    if "weights_only" in inspect.signature(L.Trainer.fit).parameters:
        assert "weights_only" in inspect.signature(L.Trainer._run).parameters


def _fingerprint(sharding: str = "FULL_SHARD", **units: int) -> dict[str, object]:
    return {"sharding_strategy": sharding, "units": units or {"": 10, "net.0": 20}}


@pytest.mark.parametrize(
    ("fingerprints", "expected"),
    [
        ([_fingerprint(), _fingerprint()], None),
        (
            [_fingerprint(), _fingerprint(**{"": 10, "net.0": 21})],
            "rank 0 vs rank 1: unit 'net.0' holds 20 vs 21 parameters",
        ),
        (
            [_fingerprint(), _fingerprint(), _fingerprint("SHARD_GRAD_OP")],
            "rank 0 vs rank 2: sharding_strategy FULL_SHARD vs SHARD_GRAD_OP",
        ),
        ([_fingerprint(), _fingerprint(**{"": 30})], "rank 0 vs rank 1: 2 FSDP units ['', 'net.0'] vs 1 units ['']"),
    ],
    ids=["agree", "a unit size", "sharding on rank 2", "the units"],
)
def test_every_rank_builds_the_same_disagreement_message_from_the_gathered_fingerprints(fingerprints, expected):
    """check_ranks_agree raises this message on every rank: each gets the same list, whichever fingerprint is its own
    (a rank that differs from rank 0 used to describe rank 0 against itself and raise StopIteration)."""
    from lightning_gaudi_fsdp import _report

    message = _report.disagreement(fingerprints)
    if expected is None:
        assert message is None
    else:
        assert message == (
            f"ranks disagree on the FSDP configuration ({expected}); every rank must build the same model with the "
            "same strategy arguments"
        )


def test_ckpt_path_last_takes_the_newest_last_checkpoint_of_the_loggers_versions_and_of_slurms_requeue(
    tmp_path, monkeypatch
):
    """What ``fit(ckpt_path="last")`` is handed (``_resume.resolve_last``, run by the launcher before Lightning
    selects the checkpoint): Lightning's own answer ("last") unless an earlier version of the same logger, or under
    SLURM a requeue checkpoint, holds a newer last checkpoint; nothing changes with ``preemption="exit"``, a
    ``ModelCheckpoint`` with its own ``dirpath``, or no logger."""
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gaudi_fsdp import _resume

    def trainer(**kwargs):
        strategy = GaudiFSDPStrategy(preemption=kwargs.pop("preemption", "save"))
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, default_root_dir=tmp_path, **kwargs)

    def touch(relative: str, mtime: float) -> str:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        os.utime(path, (mtime, mtime))
        return str(path)

    assert _resume.resolve_last(trainer(), "last") == "last"  # nothing anywhere: Lightning warns, as before
    old = touch("lightning_logs/version_0/checkpoints/last.ckpt", 1000)
    touch("lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt", 3000)  # not a last checkpoint
    assert _resume.resolve_last(trainer(), "last") == old  # the default logger's next run is version_1
    assert _resume.resolve_last(trainer(), None) is None
    assert _resume.resolve_last(trainer(), "best") == "best"
    newer = touch("lightning_logs/version_1/checkpoints/last-v1.ckpt", 2000)
    assert _resume.resolve_last(trainer(), "last") == newer
    own = touch("lightning_logs/version_7/checkpoints/last.ckpt", 1500)  # the run's own folder, older: not taken
    logged = dict(logger=CSVLogger(tmp_path, name="lightning_logs", version=7))
    assert _resume.resolve_last(trainer(**logged), "last") == newer
    os.utime(own, (2500, 2500))
    assert _resume.resolve_last(trainer(**logged), "last") == "last"  # Lightning finds it itself
    assert _resume.resolve_last(trainer(preemption="exit"), "last") == "last"
    assert _resume.resolve_last(trainer(logger=False), "last") == "last"
    assert _resume.resolve_last(trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path / "d")]), "last") == "last"
    slurm_environment(monkeypatch, tasks=2, tasks_per_node=2, rank=0, nodelist="127.0.0.1")
    on_slurm = trainer(logger=False)
    assert _resume.on_slurm(on_slurm)
    assert _resume.preemption_path(on_slurm) == str(tmp_path / "hpc_ckpt_1.ckpt")  # Lightning's requeue name
    hpc = touch("hpc_ckpt_1.ckpt", 4000)
    assert _resume.preemption_path(on_slurm) == str(tmp_path / "hpc_ckpt_2.ckpt")
    assert _resume.resolve_last(on_slurm, "last") == hpc
    assert _resume.resolve_last(on_slurm, None) is None  # Lightning restores it itself
