"""The resolvers that turn YAML-friendly values into torch FSDP objects, and their error messages."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_gaudi_fsdp import module_options, options

pytestmark = pytest.mark.versions  # also run on the older torch/Lightning pairings in CI


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("FULL_SHARD", ShardingStrategy.FULL_SHARD),
        ("full_shard", ShardingStrategy.FULL_SHARD),
        ("Shard_Grad_Op", ShardingStrategy.SHARD_GRAD_OP),
        ("no_shard", ShardingStrategy.NO_SHARD),
        ("hybrid_shard", ShardingStrategy.HYBRID_SHARD),
        ("_hybrid_shard_zero2", ShardingStrategy._HYBRID_SHARD_ZERO2),
        ("ShardingStrategy.FULL_SHARD", ShardingStrategy.FULL_SHARD),
        (ShardingStrategy.NO_SHARD, ShardingStrategy.NO_SHARD),
    ],
)
def test_sharding_strategy_names_in_any_case(value, expected):
    assert options.resolve_sharding_strategy(value) is expected


def test_sharding_strategy_error_lists_accepted_values():
    with pytest.raises(
        ValueError,
        match=r"^sharding_strategy='FULL' is not supported; expected one of 'FULL_SHARD', "
        r"'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD', '_HYBRID_SHARD_ZERO2'$",
    ):
        options.resolve_sharding_strategy("FULL")
    with pytest.raises(TypeError, match="sharding_strategy must be a string or a ShardingStrategy, got int 3"):
        options.resolve_sharding_strategy(3)


def test_backward_prefetch():
    assert options.resolve_backward_prefetch("backward_post") is BackwardPrefetch.BACKWARD_POST
    assert options.resolve_backward_prefetch(BackwardPrefetch.BACKWARD_PRE) is BackwardPrefetch.BACKWARD_PRE
    assert options.resolve_backward_prefetch(None) is None
    assert options.resolve_backward_prefetch("None") is None
    with pytest.raises(
        ValueError, match="backward_prefetch='PRE' is not supported; expected one of 'BACKWARD_PRE', 'BACKWARD_POST'"
    ):
        options.resolve_backward_prefetch("PRE")


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        ("FP16", torch.float16),
        (torch.float64, torch.float64),
    ],
)
def test_dtype_names(value, dtype):
    assert options.resolve_dtype(value) is dtype


def test_dtype_error_names_argument():
    with pytest.raises(
        ValueError,
        match=r"^mixed_precision\['param_dtype'\]='int8' is not supported; expected one of "
        r"'bfloat16', 'bf16'",
    ):
        options.resolve_mixed_precision({"param_dtype": "int8"})


def test_mixed_precision_from_dict():
    mp = options.resolve_mixed_precision(
        {
            "param_dtype": "bf16",
            "reduce_dtype": "float32",
            "buffer_dtype": "torch.bfloat16",
            "keep_low_precision_grads": True,
            "cast_forward_inputs": True,
            "cast_root_forward_inputs": False,
        }
    )
    assert mp == MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16, True, True, False)
    same = MixedPrecision(param_dtype=torch.float16)
    assert options.resolve_mixed_precision(same) is same
    assert options.resolve_mixed_precision(None) is None


def test_mixed_precision_errors():
    with pytest.raises(
        ValueError,
        match=r"mixed_precision has unknown key\(s\) 'recude_dtype'; expected any of "
        r"'param_dtype', 'reduce_dtype'",
    ):
        options.resolve_mixed_precision({"recude_dtype": "bf16"})
    with pytest.raises(
        TypeError,
        match=r"mixed_precision\['keep_low_precision_grads'\] must be True or False, got "
        r"str 'yes'",
    ):
        options.resolve_mixed_precision({"keep_low_precision_grads": "yes"})
    with pytest.raises(TypeError, match="mixed_precision must be a dict or a MixedPrecision, got str 'bf16'"):
        options.resolve_mixed_precision("bf16")


def test_cpu_offload():
    assert options.resolve_cpu_offload(True) == CPUOffload(offload_params=True)
    assert options.resolve_cpu_offload(False) == CPUOffload(offload_params=False)
    assert options.resolve_cpu_offload(None) == CPUOffload(offload_params=False)
    with pytest.raises(TypeError, match="cpu_offload must be True or False, got str 'TRUE'"):
        options.resolve_cpu_offload("TRUE")


def test_auto_wrap_policy_from_classes_names_and_sets():
    for value in ({torch.nn.Linear}, [torch.nn.Linear], "torch.nn.Linear", ["torch.nn.Linear"], torch.nn.Linear):
        policy = module_options.resolve_auto_wrap_policy(value)
        assert isinstance(policy, ModuleWrapPolicy)
        assert policy._module_classes == {torch.nn.Linear}


def test_auto_wrap_policy_int_is_size_based():
    policy = module_options.resolve_auto_wrap_policy(1000)
    assert isinstance(policy, functools.partial)
    assert policy.keywords == {"min_num_params": 1000}
    with pytest.raises(ValueError, match="auto_wrap_policy=0 must be a positive min_num_params"):
        module_options.resolve_auto_wrap_policy(0)


def test_auto_wrap_policy_callable_passes_through():
    def policy(module, recurse, nonwrapped_numel):
        return False

    assert module_options.resolve_auto_wrap_policy(policy) is policy


def test_auto_wrap_policy_errors():
    with pytest.raises(
        ValueError,
        match=r"auto_wrap_policy: module 'torch.nn' has no attribute 'Linearr'; did you "
        r"mean 'torch.nn.Linear'",
    ):
        module_options.resolve_auto_wrap_policy(["torch.nn.Linearr"])
    with pytest.raises(ValueError, match="auto_wrap_policy: cannot import module 'no_such_pkg'"):
        module_options.resolve_auto_wrap_policy("no_such_pkg.Layer")
    with pytest.raises(TypeError, match="auto_wrap_policy: 'torch.Tensor' is not a torch.nn.Module subclass"):
        module_options.resolve_auto_wrap_policy(["torch.Tensor"])
    with pytest.raises(TypeError, match="auto_wrap_policy must not be a bool"):
        module_options.resolve_auto_wrap_policy(True)
    with pytest.raises(ValueError, match="auto_wrap_policy is empty"):
        module_options.resolve_auto_wrap_policy([])


def test_activation_checkpointing_policy():
    kwargs = module_options.resolve_activation_checkpointing_policy(["torch.nn.Linear"])
    check = kwargs["check_fn"]
    assert check(torch.nn.Linear(2, 2))
    assert not check(torch.nn.ReLU())
    assert module_options.resolve_activation_checkpointing_policy(None) == {}
    policy = ModuleWrapPolicy({torch.nn.Linear})
    assert module_options.resolve_activation_checkpointing_policy(policy) == {"auto_wrap_policy": policy}
    assert module_options.resolve_activation_checkpointing_policy(callable) == {"check_fn": callable}


def test_state_dict_type():
    assert options.resolve_state_dict_type("FULL") == "full"
    assert options.resolve_state_dict_type("Local") == "local"
    with pytest.raises(
        ValueError, match="state_dict_type='distributed' is not supported; expected one of 'full', 'sharded', 'local'"
    ):
        options.resolve_state_dict_type("distributed")


def test_device_mesh():
    assert options.resolve_device_mesh([2, 4]) == (2, 4)
    assert options.resolve_device_mesh((1, 8)) == (1, 8)
    for bad in ([2], [2, 0], [2, "4"], [True, 2], "2x4"):
        with pytest.raises(ValueError, match=r"device_mesh=.* is not supported; expected \(replicas, shard_size\)"):
            options.resolve_device_mesh(bad)


def test_hybrid_needs_a_policy_group_or_mesh():
    with pytest.raises(
        ValueError,
        match="sharding_strategy='HYBRID_SHARD' needs at least one of auto_wrap_policy, process_group or device_mesh",
    ):
        options.check_hybrid_requirements(ShardingStrategy.HYBRID_SHARD, None, None, None)
    with pytest.raises(ValueError, match="device_mesh=.* only applies to hybrid sharding"):
        options.check_hybrid_requirements(ShardingStrategy.FULL_SHARD, None, None, (2, 2))


def test_local_state_dict_rejects_no_shard_and_mesh():
    with pytest.raises(
        ValueError, match="state_dict_type='local' needs a sharded strategy; sharding_strategy='NO_SHARD'"
    ):
        options.check_state_dict_type("local", ShardingStrategy.NO_SHARD, None)
    with pytest.raises(ValueError, match="state_dict_type='local' cannot be used with a device_mesh"):
        options.check_state_dict_type("local", ShardingStrategy.HYBRID_SHARD, (2, 2))


def test_submodule_names_resolve_with_close_matches():
    model = torch.nn.Sequential()
    model.add_module("encoder", torch.nn.Linear(2, 2))
    model.add_module("head", torch.nn.Linear(2, 1))
    assert module_options.resolve_submodules(model, ["head"], "ignored_modules") == [model.head]
    assert module_options.resolve_submodules(model, ["head.bias"], "ignored_states", True) == [model.head.bias]
    with pytest.raises(ValueError, match=r"ignored_modules: 'haed' is not a module of Sequential; closest: 'head'"):
        module_options.resolve_submodules(model, ["haed"], "ignored_modules")


def test_compile():
    assert options.resolve_compile(False) is None
    assert options.resolve_compile(True) == {}
    assert options.resolve_compile({"backend": "eager"}) == {"backend": "eager"}
    with pytest.raises(TypeError, match="compile must be True, False or a dict"):
        options.resolve_compile("yes")
