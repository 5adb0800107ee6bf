"""The upstream names the three adapter modules rely on, checked on the torch and Lightning at hand (CI runs this on
every supported pairing): a release that moves one fails here, naming it, instead of switching a feature off."""

from __future__ import annotations

import ast
import inspect
import io
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from packaging.version import Version
from torch import nn

from lightning_gaudi_fsdp import _compat
from lightning_gaudi_fsdp.adapters import buffers, fsdp1_internals, lightning_internals, torch_internals

pytestmark = pytest.mark.versions  # also run on the older torch/Lightning pairings in CI

SRC = Path(__file__).resolve().parents[1] / "src" / "lightning_gaudi_fsdp"


# ------------------------------------------------------------------------------------------------- FSDP1 internals
def test_fsdp1_flat_parameter_internals_are_where_the_unit_view_reads_them():
    import torch.distributed.fsdp._flat_param as flat_param_module
    import torch.distributed.fsdp._init_utils as init_utils

    source = inspect.getsource(flat_param_module)
    for name in (*fsdp1_internals.FLAT_PARAMETER_ATTRIBUTES, *fsdp1_internals.FLAT_PARAMETER_OPTIONAL):
        assert f".{name}" in source, f"torch's FlatParameter no longer sets {name}"
    assert "def uses_sharded_strategy" in source
    assert flat_param_module._ShardParamInfo._fields == fsdp1_internals.SHARD_INFO_FIELDS
    assert issubclass(flat_param_module.FlatParameter, nn.Parameter)
    assert not fsdp1_internals.is_flat_parameter(nn.Parameter(torch.zeros(1)))
    init_source = inspect.getsource(init_utils)
    for name in ("_handle", "_device_mesh", "_ignored_params", "_buffer_name_to_orig_dtype", "_use_orig_params"):
        assert f".{name} =" in init_source, f"FSDP1's state no longer has {name}"
    assert inspect.ismodule(__import__(fsdp1_internals.STATE_DICT_HOOK_MODULE, fromlist=["_"]))


def test_fsdp1_names_policies_and_errors():
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapped = "_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.weight"
    assert fsdp1_internals.clean_name(wrapped) == "layers.0.weight"
    assert fsdp1_internals.join_name("", "a") == "a"
    assert fsdp1_internals.join_name("p", "a") == "p.a"
    assert fsdp1_internals.hybrid_zero2() in ShardingStrategy
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    policy = ModuleWrapPolicy({nn.Linear})
    assert fsdp1_internals.is_policy(policy)
    assert not fsdp1_internals.is_policy(lambda m: True)
    assert fsdp1_internals.policy_targets(policy, model, set()) == {model[0], model[2]}
    assert fsdp1_internals.units(model) == []
    assert fsdp1_internals.unit_sizes(model) == {}
    wrap_utils = inspect.getsource(__import__("torch.distributed.fsdp._wrap_utils", fromlist=["_"]))
    assert "has both parameters with requires_grad=True and False" in wrap_utils
    err = ValueError("layers.0 has both parameters with requires_grad=True and False. ...")
    assert fsdp1_internals.mixed_requires_grad_unit(err) == "layers.0"
    assert fsdp1_internals.mixed_requires_grad_unit(ValueError("other")) is None


# ------------------------------------------------------------------------------------------------- torch internals
def test_the_streaming_writer_writes_what_torch_save_writes(tmp_path):
    assert torch_internals.streaming_writer_available()
    state = {"a": torch.arange(6.0).view(2, 3), "b": [torch.ones(2, dtype=torch.bfloat16)], "n": 3}
    order = torch_internals.storage_order(state, io.BytesIO())
    assert order == [state["a"].data_ptr(), state["b"][0].data_ptr()]
    records: list[str] = []

    class Passing:
        def __init__(self, writer):
            self.writer = writer

        def write_record(self, name, data, size):
            records.append(name)
            self.writer.write_record(name, data, size)

        def __getattr__(self, name):
            return getattr(self.writer, name)

    with open(tmp_path / "streamed.pt", "wb") as handle:
        torch_internals.save_through(state, handle, Passing)
    plain = io.BytesIO()
    torch.save(state, plain)
    assert any(name.startswith("data/") for name in records)
    loaded = torch.load(tmp_path / "streamed.pt", weights_only=True)
    assert torch.equal(loaded["a"], state["a"])
    assert loaded["n"] == 3
    assert (tmp_path / "streamed.pt").stat().st_size == len(plain.getvalue())


def test_dcp_and_safe_unpickling_entry_points():
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    for function in (_load_state_dict, _save_state_dict):
        parameters = inspect.signature(function).parameters
        assert {"no_dist", "planner"} <= set(parameters), f"{function.__name__}: {list(parameters)}"
    assert "storage_reader" in inspect.signature(_load_state_dict).parameters
    assert "storage_writer" in inspect.signature(_save_state_dict).parameters
    assert isinstance(torch_internals.empty_load_planner({"a"}), _EmptyStateDictLoadPlanner)
    info = torch_internals.private_safe_global("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    assert info is not None
    assert info.__name__ == "_StorageInfo"
    assert torch_internals.private_safe_global("torch.serialization", "_get_layout") is not None
    assert torch_internals.private_safe_global("os", "system") is None


def test_sharded_and_distributed_tensor_internals():
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    assert "process_group" in inspect.signature(ShardedTensor._init_from_local_shards_and_global_metadata).parameters
    assert {"_local_tensor", "_spec"} <= set(DTensor.__slots__)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert list(inspect.signature(compute_local_shape_and_global_offset).parameters)[:3] == [
        "global_shape",
        "mesh",
        "placements",
    ]
    placement = torch_internals.host_placement(1)
    assert placement.rank() == 1
    assert placement.device().type == "cpu"
    tensor = torch.zeros(3)
    before = torch_internals.version_counter(tensor)
    tensor.add_(1)
    assert torch_internals.version_counter(tensor) == before + 1


def test_module_and_autograd_internals():
    layer = nn.Linear(2, 3)
    layer.register_buffer("count", torch.tensor(4))
    own = torch_internals.own_state(layer, "p.")
    assert list(own) == ["p.weight", "p.bias", "p.count"]
    assert torch_internals.state_dict_hook_modules(layer) == []
    layer.register_state_dict_post_hook(lambda *args: None)
    assert torch_internals.state_dict_hook_modules(layer) == [__name__]
    replacement = nn.Parameter(torch.ones(3))
    torch_internals.replace_parameter(layer, "bias", replacement)
    assert layer.bias is replacement
    torch_internals.apply_to_own_tensors(layer, lambda t: t.double())
    assert layer.weight.dtype == torch.float64
    assert isinstance(layer.weight, nn.Parameter)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch_internals.in_backward())
            return grad

    assert not torch_internals.in_backward()
    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [True]


def test_has_hpu_kernel_tells_an_op_with_an_hpu_kernel_from_one_without():
    """What ``doctor`` reports for FSDP2 on Gaudi: two ops of our own, one given an HPU kernel, and aten's ``add``
    (no HPU kernel in a CPU build of torch)."""
    from lightning_gaudi_fsdp.adapters import torch_internals

    lib = torch.library.Library("lgf_test_kernels", "DEF")
    for name in ("on_hpu", "cpu_only"):
        lib.define(f"{name}(Tensor x) -> Tensor")
    lib.impl("on_hpu", lambda x: x, "HPU")
    lib.impl("cpu_only", lambda x: x, "CPU")
    assert torch_internals.has_hpu_kernel("lgf_test_kernels::on_hpu") is True
    assert torch_internals.has_hpu_kernel("lgf_test_kernels::cpu_only") is False
    assert torch_internals.has_hpu_kernel("aten::add.Tensor") is False
    if Version("2.9") <= _compat.TORCH_VERSION:  # checked in torch 2.9 and 2.13: FSDP2's copy-in ops have HPU kernels
        assert torch_internals.has_hpu_kernel("fsdp::all_gather_copy_in") is True


def test_activation_checkpointing_wrapper():
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as wrapper_module

    assert wrapper_module.__name__ == torch_internals.CHECKPOINT_WRAPPER_MODULE
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    torch_internals.apply_checkpoint_wrapper(model, check_fn=lambda m: isinstance(m, nn.Linear))
    assert torch_internals.is_checkpoint_wrapper(model[0])
    assert not torch_internals.is_checkpoint_wrapper(model[1])


# ---------------------------------------------------------------------------------------------- raw memory (ctypes)
def test_buffer_addresses_raw_bytes_and_writeback(tmp_path):
    tensor = torch.arange(24, dtype=torch.float32)
    chunk = tensor.view(torch.uint8)
    data = buffers.raw(chunk)  # what the streamed save hands the file: the tensor's own memory, not a copy
    assert bytes(data) == tensor.numpy().tobytes()
    assert buffers.address(data) == tensor.data_ptr()
    assert buffers.address(memoryview(data)[8:]) == tensor.data_ptr() + 8
    readonly = bytes(range(16))  # torch's zip writer hands over read-only buffers too
    assert buffers.address(readonly) == buffers.address(memoryview(readonly))
    assert buffers.address(memoryview(readonly)[3:]) == buffers.address(readonly) + 3
    with pytest.raises(TypeError):  # not a buffer (CPython says so)
        buffers.address(3)
    path = tmp_path / "file"
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_WRONLY)
    try:
        buffers.start_writeback(fd, 0, len(data))  # advisory: no error, the bytes unchanged
    finally:
        os.close(fd)
    assert path.read_bytes() == tensor.numpy().tobytes()


# --------------------------------------------------------------------------------------------- Lightning internals
def test_lightning_call_stack_facts_have_the_shape_they_rely_on():
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    assert callable(_CheckpointConnector.dump_checkpoint)
    assert "dump_checkpoint" in L.Trainer.save_checkpoint.__code__.co_names  # save_checkpoint calls it directly
    assert not lightning_internals.building_checkpoint_to_save()
    if "weights_only" in inspect.signature(L.Trainer.fit).parameters:
        assert "weights_only" in inspect.signature(L.Trainer._run).parameters
    assert lightning_internals.fit_weights_only(L.Trainer(logger=False, enable_checkpointing=False)) is None


def test_lightning_helpers_the_doors_reuse():
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy()
    assert callable(strategy._forward_redirection)
    module = L.LightningModule()
    assert lightning_internals.attached_trainer(module) is None
    lightning_internals.move_torchmetrics_to_device(nn.Linear(1, 1), torch.device("cpu"))
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert callable(_TrainingEpochLoop._should_accumulate)  # lightning_internals.accumulating
    assert inspect.isabstract(lightning_internals.BackwardSyncControl)
    assert isinstance(nn.Linear(1, 1), lightning_internals.Stateful)
    with pytest.raises(KeyError, match="missing"):
        lightning_internals.validate_keys_for_strict_loading(["missing"], [], strict=True)
    from lightning.pytorch.callbacks import ThroughputMonitor

    assert lightning_internals.stage_throughputs(ThroughputMonitor(batch_size_fn=len)) == []  # filled by its setup


def test_lightning_names_the_preemption_resume_relies_on(tmp_path):
    """``fit``'s launch hands ``_fit_impl`` a ``ckpt_path`` the launcher may replace; Lightning's SLURM requeue names;
    ``ModelCheckpoint``'s lookup of ``last*.ckpt``; the handlers inside Lightning's SIGTERM handler."""
    import signal

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

    assert "ckpt_path" in inspect.signature(L.Trainer._fit_impl).parameters
    assert "_fit_impl" in L.Trainer.fit.__code__.co_names
    trainer = L.Trainer(logger=False, default_root_dir=tmp_path, accelerator="cpu", devices=1)
    seen = []

    class Launcher:
        def launch(self, function, *args, trainer=None, **kwargs):
            seen.append(inspect.signature(function).bind(*args, **kwargs).arguments["ckpt_path"])

    class Door:
        _launcher = Launcher()

    door = Door()
    lightning_internals.resolve_fit_ckpt_path(door, lambda trainer, path: f"resolved:{path}")
    door._launcher.launch(trainer._fit_impl, None, None, None, None, "last", trainer=trainer)
    assert seen == ["resolved:last"]
    bare = type("Bare", (), {"_launcher": None})()
    lightning_internals.resolve_fit_ckpt_path(bare, lambda trainer, path: f"resolved:{path}")
    assert bare._launcher.launch(lambda ckpt_path: ckpt_path, "x", trainer=None) == "x"  # not fit: untouched
    assert lightning_internals.hpc_save_path(str(tmp_path)) == str(tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_1.ckpt").write_text("")
    assert lightning_internals.hpc_resume_path(trainer) == str(tmp_path / "hpc_ckpt_1.ckpt")
    callback = ModelCheckpoint(dirpath=tmp_path)
    (tmp_path / "last-v1.ckpt").write_text("")
    assert lightning_internals.last_checkpoints(callback, trainer) == {str(tmp_path / "last-v1.ckpt")}
    mine = signal.default_int_handler
    connector = _SignalConnector(trainer)
    composed = _HandlersCompose([connector._sigterm_notifier_fn, connector._sigterm_handler_fn, mine])
    assert lightning_internals.chained_sigterm_handlers(composed) == [mine]
    assert lightning_internals.chained_sigterm_handlers(mine) is None


# --------------------------------------------------------------------------------------------------- architecture
def _private_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.module)
            found += [alias.name for alias in node.names if alias.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [
                alias.name
                for alias in node.names
                if alias.name.split(".")[0] in ("torch", "lightning")
                and any(part.startswith("_") for part in alias.name.split("."))
            ]
    return found


def test_only_the_adapters_import_private_torch_and_lightning_names():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.parent.name == "adapters":
            continue
        found = _private_imports(ast.parse(path.read_text()))
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert offenders == {}


def test_resume_train_loaders_resumes_a_stateful_loader_in_any_epoch():
    """``scripts/repro_midepoch_resume.py`` (plain Lightning, one process, a shuffled ``DistributedSampler`` under
    torchdata's ``StatefulDataLoader``), resumed with what ``GaudiFSDPStrategy`` does in ``load_checkpoint`` and
    ``on_train_start``: every resume trains what the uninterrupted run trained, in the first epoch (step 3), in the
    second (step 11) and from the checkpoint after the first epoch's last batch (step 8)."""
    import importlib.util

    from lightning.pytorch.callbacks import Callback

    path = Path(__file__).parents[1] / "scripts" / "repro_midepoch_resume.py"
    spec = importlib.util.spec_from_file_location("repro_midepoch_resume", path)
    repro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repro)

    class AsTheStrategyDoes(Callback):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            self.states = lightning_internals.saved_train_loader_states(checkpoint)

        def on_train_start(self, trainer, pl_module):
            lightning_internals.resume_train_loaders(trainer, self.states)

    assert repro.resumes(callbacks=(AsTheStrategyDoes(),)) == {3: True, 11: True, 8: True}
