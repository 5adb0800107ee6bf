"""Real 2-process (and 4-process) FSDP training on CPU over gloo: each strategy argument shows its effect."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import BLOCK, assert_close_weights, changed

FEATURES_HEAD = 16 + 1  # the output layer: a 16-wide weight and a bias

ENGINES = pytest.mark.parametrize("engine", [1, 2])

# What the fit-start table says each rank holds: FSDP1 flattens 3 blocks of 304 elements and the root's 17 (padded
# to 18) and halves each; FSDP2 halves every block parameter along dim 0, and the head's single row lands on rank 0.
HELD = {
    1: "flat parameters per rank : 465 elements on each of 2 rank(s)",
    2: "parameter shards per rank : 456 to 473 elements (rank 0 holds the most)",
}


@pytest.mark.versions
@pytest.mark.parametrize(
    ("engine", "sharding", "devices"),
    [
        (1, "FULL_SHARD", 2),
        (1, "SHARD_GRAD_OP", 2),
        (2, "FULL_SHARD", 2),
        (2, "SHARD_GRAD_OP", 2),
        (2, "HYBRID_SHARD", 4),
    ],
)
def test_two_ranks_match_one_process_on_the_global_batch(scenario, reference_run, engine, sharding, devices):
    steps = 5
    # SGD with momentum: AdamW's update does not change when a gradient is scaled, so it could not tell a unit whose
    # gradients were summed over the ranks from one whose gradients were averaged
    optimizer = {"optimizer": "sgd_momentum"}
    ref = reference_run(max_steps=steps, module={**optimizer, "batch_size": 8})  # one run for every case
    strategy = {"sharding_strategy": sharding, "auto_wrap_policy": [BLOCK], "fsdp_version": engine}
    if devices == 4:
        strategy["device_mesh"] = [2, 2]
    sharded = scenario(
        {
            "strategy": strategy,
            "devices": devices,
            "max_steps": steps,
            "module": {**optimizer, "batch_size": 8 // devices},
        }
    )
    got = sharded.final()
    assert got["step"] == ref["step"] == steps
    if devices == 2:
        assert HELD[engine] in sharded.proc.stdout + sharded.proc.stderr
    assert_close_weights(got["weights"], ref["weights"], atol=1e-5)
    # the run really moved the weights (a parity test on untouched weights proves nothing)
    assert changed(reference_run(max_steps=0, module={"batch_size": 8})["weights"], ref["weights"])


@pytest.fixture(scope="module")
def full_shard_run(tmp_path_factory):
    from conftest import run_script

    cfg = {
        "strategy": {
            "sharding_strategy": "full_shard",
            "auto_wrap_policy": [BLOCK],
            "activation_checkpointing_policy": [BLOCK],
            "backward_prefetch": "backward_post",
            "forward_prefetch": True,
            "limit_all_gathers": False,
            "ignored_modules": ["net.head"],
        },
        "max_steps": 3,
    }
    return run_script("train.py", cfg, tmp_path_factory.mktemp("full_shard"))


@pytest.mark.versions
def test_full_shard_gives_each_rank_half_of_every_flat_parameter(full_shard_run):
    for rank in (0, 1):
        units = [u for u in full_shard_run.rank(rank)["units"] if "local_numel" in u]
        assert len(units) == 3  # the three blocks; the root holds nothing once the head is ignored
        for unit in units:
            assert unit["local_numel"] == math.ceil(unit["unsharded_numel"] / 2)


def test_auto_wrap_policy_makes_one_unit_per_block(full_shard_run):
    names = [u["name"] for u in full_shard_run.rank(0)["units"]]
    assert len(names) == 4
    assert [n.rsplit(".", 2)[-2:] for n in names[1:]] == [["blocks", "0"], ["blocks", "1"], ["blocks", "2"]]


def test_ignored_module_stays_whole_on_every_rank(full_shard_run):
    for rank in (0, 1):
        info = full_shard_run.rank(rank)
        assert info["ignored_params"] == ["net.head.bias", "net.head.weight"]
        assert all("head" not in f for u in info["units"] for f in u.get("fqns", []))


def test_activation_checkpointing_wraps_each_block(full_shard_run):
    assert full_shard_run.rank(0)["checkpoint_wrappers"] == 3


def test_prefetch_and_limit_settings_reach_every_unit(full_shard_run):
    for unit in full_shard_run.rank(1)["units"]:
        assert unit["forward_prefetch"] is True
        assert unit["limit_all_gathers"] is False
        assert unit["backward_prefetch"] == "BACKWARD_POST"
        assert unit["use_orig_params"] is True
        assert unit["compute_device"] == "cpu"


def test_no_shard_keeps_full_parameters_and_use_orig_params_false(scenario):
    run = scenario({"strategy": {"sharding_strategy": "NO_SHARD", "use_orig_params": False}, "max_steps": 2})
    (unit,) = run.rank(1)["units"]
    assert unit["sharding_strategy"] == "NO_SHARD"
    assert unit["use_orig_params"] is False
    assert unit["local_numel"] == unit["unsharded_numel"]
    # the user's configure_optimizers (a hook that may count, or build a scheduler from the stepping batches) ran once
    assert [run.rank(r)["configure_optimizers_calls"] for r in (0, 1)] == [1, 1]


def test_size_based_policy_from_an_int(scenario):
    # Each block holds 16*16+16+16+16 = 304 parameters; a threshold of 300 makes each block its own unit.
    run = scenario({"strategy": {"auto_wrap_policy": 300}, "max_steps": 1})
    assert len(run.rank(0)["units"]) == 4


@ENGINES
@pytest.mark.parametrize(("sync", "expected"), [(True, [0.01]), (False, [0.01, 0.02])])
def test_sync_module_states_broadcasts_rank_zero_weights(scenario, sync, expected, engine):
    run = scenario(
        {
            "strategy": {"auto_wrap_policy": [BLOCK], "sync_module_states": sync, "fsdp_version": engine},
            "module": {"rank_dependent_init": True},
            "max_steps": 1,
        }
    )
    assert run.rank(0)["initial_unique_values"] == expected


@ENGINES
def test_param_init_fn_materialises_a_meta_model(scenario, engine):
    run = scenario(
        {
            "strategy": {"auto_wrap_policy": [BLOCK], "param_init_fn": "common.fill_init", "fsdp_version": engine},
            "module": {"meta_init": True},
            "max_steps": 1,
        }
    )
    assert run.rank(0)["initial_unique_values"] == [0.125]


def test_mixed_precision_dict_sets_the_dtype_layers_compute_in(scenario):
    run = scenario(
        {
            "strategy": {
                "auto_wrap_policy": [BLOCK],
                "mixed_precision": {
                    "param_dtype": "bf16",
                    "reduce_dtype": "float32",
                    "buffer_dtype": "torch.bfloat16",
                    "cast_root_forward_inputs": True,
                },
            },
            "max_steps": 2,
        }
    )
    info = run.rank(0)
    assert info["fc_forward"] == {"input": "torch.bfloat16", "weight": "torch.bfloat16", "output": "torch.bfloat16"}
    # The LightningModule is the FSDP root and training_step runs inside its forward, so the batch reaching
    # training_step is cast to param_dtype by cast_root_forward_inputs.
    assert info["seen_dtypes"]["training_step_matmul"] == "torch.bfloat16"


@ENGINES
@pytest.mark.versions
def test_mixed_precision_from_a_dict_keeps_the_batch_dtypes_and_trains_on_every_torch(scenario, engine):
    # lightning-habana's default on Gaudi (bf16 parameters, fp32 reduction) with SHARD_GRAD_OP and prefetching: on
    # torch 2.6-2.9 it failed in backward when the root cast the float32 targets to bf16 for the user's loss.
    run = scenario(
        {
            "strategy": {
                "sharding_strategy": "shard_grad_op",
                "auto_wrap_policy": [BLOCK],
                "backward_prefetch": "backward_post" if engine == 1 else "backward_pre",
                "fsdp_version": engine,
                "forward_prefetch": True,
                "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
            },
            "max_steps": 3,
        }
    )
    for rank in (0, 1):
        info = run.rank(rank)
        assert info["global_step"] == 3
        assert info["fc_forward"] == {"input": "torch.bfloat16", "weight": "torch.bfloat16", "output": "torch.bfloat16"}
        assert info["seen_dtypes"]["target"] == "torch.float32"  # the batch reaching training_step is not cast
        assert all(math.isfinite(loss) for loss in info["losses"])


@ENGINES
@pytest.mark.versions
def test_trainer_bf16_mixed_autocasts_on_the_cpu(scenario, engine):
    run = scenario(
        {
            "strategy": {"auto_wrap_policy": [BLOCK], "fsdp_version": engine},
            "trainer": {"precision": "bf16-mixed"},
            "max_steps": 2,
        }
    )
    info = run.rank(1)
    assert info["precision_plugin"] == "GaudiFSDPPrecision"
    # Lightning's own FSDPPrecision autocasts on "cuda" only, which leaves a float32 op in fp32 on a CPU run.
    assert info["seen_dtypes"]["training_step_matmul"] == "torch.bfloat16"
    assert info["seen_dtypes"]["training_step_fp32_matmul"] == "torch.bfloat16"
    assert info["fc_forward"]["output"] == "torch.bfloat16"
    if engine == 1:  # as with Lightning's FSDPStrategy, the precision plugin sets FSDP1 units' dtypes: bf16
        # parameters on Lightning 2.6, fp32 parameters with bf16 reduction and buffers on Lightning 2.5
        from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

        expected = FSDPPrecision("bf16-mixed").mixed_precision_config
        assert info["units"]
        for unit in info["units"]:
            assert f"param_dtype={expected.param_dtype}" in unit["mixed_precision"]
            assert f"reduce_dtype={expected.reduce_dtype}" in unit["mixed_precision"]


def test_cpu_offload_on_a_cpu_run_is_ignored_with_a_warning(scenario):
    run = scenario({"strategy": {"auto_wrap_policy": [BLOCK], "cpu_offload": True}, "max_steps": 2})
    assert "cpu_offload=True has no effect when the model already runs on the CPU" in run.proc.stderr
    assert not any(u["cpu_offload"] for u in run.rank(0)["units"])
    assert run.rank(0)["global_step"] == 2


@ENGINES
@pytest.mark.versions
def test_compile_compiles_the_root_in_place_and_trains_like_an_uncompiled_run(scenario, reference_run, engine):
    run = scenario(
        {
            "strategy": {"auto_wrap_policy": [BLOCK], "compile": True, "fsdp_version": engine},
            "max_steps": 2,
            "probes": ["dynamo"],
        }
    )
    info = run.rank(0)
    assert info["compiled_modules"] == 1  # the FSDP root, compiled in place: dynamo traces each unit inside it
    assert info["dynamo_frames_ok"] > 0
    # the same steps as without compile (one process on the global batch: the 2-rank uncompiled run equals it, above)
    ref = reference_run(max_steps=2, module={"batch_size": 8})
    assert_close_weights(run.final()["weights"], ref["weights"], atol=1e-5)
    assert changed(reference_run(max_steps=0, module={"batch_size": 8})["weights"], ref["weights"])


@pytest.mark.versions
@pytest.mark.parametrize("policy", [[BLOCK], None])
def test_hybrid_shard_on_a_2x2_mesh_shards_within_each_pair(scenario, policy):
    run = scenario(
        {
            "devices": 4,
            "strategy": {"sharding_strategy": "HYBRID_SHARD", "device_mesh": [2, 2], "auto_wrap_policy": policy},
            "max_steps": 2,
        }
    )
    for rank in range(4):
        for unit in run.rank(rank)["units"]:
            assert unit["sharding_strategy"] == "HYBRID_SHARD"
            if "local_numel" in unit:
                assert unit["local_numel"] == math.ceil(unit["unsharded_numel"] / 2)


@ENGINES
def test_ignored_states_by_name_stay_whole_and_train_like_one_process(scenario, engine):
    """The head, named in ``ignored_states``, is no unit's: every rank keeps it whole (the harness checks the ranks'
    copies are equal) and its gradients are averaged over the ranks, so 2 ranks equal one process."""
    run = scenario(
        {
            "strategy": {
                "auto_wrap_policy": [BLOCK],
                "ignored_states": ["net.head.weight", "net.head.bias"],
                "fsdp_version": engine,
            },
            "max_steps": 3,
            "module": {"batch_size": 4},
        }
    )
    assert run.rank(1)["ignored_params"] == ["net.head.bias", "net.head.weight"]
    assert sorted(torch.load(run.out / "replicated1.pt", weights_only=True)) == ["net.head.bias", "net.head.weight"]
    reference = scenario({"strategy": "reference", "max_steps": 3, "module": {"batch_size": 8}}).final()
    assert_close_weights(run.final()["weights"], reference["weights"], atol=1e-5)


def test_unknown_ignored_module_name_lists_close_matches(scenario):
    run = scenario({"strategy": {"ignored_modules": ["net.haed"]}, "max_steps": 1}, expect_ok=False, timeout=120)
    assert run.proc.returncode != 0
    assert "ignored_modules: 'net.haed' is not a module of Module; closest: 'net.head'" in run.proc.stderr


@pytest.mark.parametrize(
    ("engine", "door"),
    [
        (1, "trainer"),
        (2, "trainer"),
        (2, "fabric"),
        pytest.param(1, "fabric", marks=pytest.mark.slow),  # the default job has the hand-wrapped Llama's case
    ],
)
def test_manual_wrapping_with_a_layer_outside_the_units_matches_one_process(scenario, engine, door):
    """Lightning's manual wrapping: ``wrap()`` on each block inside ``configure_model`` (Trainer) or under
    ``fabric.init_module()`` (Fabric), the output layer left outside the user's units. The rest of the model belongs
    to a root unit: the head is sharded (no rank keeps a plain copy that trains on its own data, which the harness
    would see as replicated tensors differing between ranks), and 2 ranks equal one process on the global batch."""
    steps = 4
    strategy = {"fsdp_version": engine, "activation_checkpointing_policy": [BLOCK]}
    if engine == 1:
        strategy["limit_all_gathers"] = False
    if door == "trainer":
        # each rank starts from its own values: sync_module_states must give every unit and the root rank 0's
        init = {"rank_dependent_init": "offset", "buffer": True}  # a buffer outside the units, too
        reference = scenario({"strategy": "reference", "max_steps": steps, "module": {**init, "batch_size": 8}})
        reference = reference.final()
        module = {**init, "manual_wrap": True, "batch_size": 4}
        run = scenario({"strategy": {**strategy, "sync_module_states": True}, "module": module, "max_steps": steps})
        got = run.final()
        assert got["step"] == reference["step"] == steps
        assert run.rank(1)["checkpoint_wrappers"] == 3  # activation checkpointing applies to units wrapped by hand
        units = run.rank(0)["units"]
        if engine == 1:
            assert [u["name"].rsplit(".", 1)[-1] for u in units] == ["", "0", "1", "2"]
            assert units[0]["fqns"] == ["net.head.weight", "net.head.bias"]  # what the user left out: the root's
            assert all(u["compute_device"] == "cpu" and u["limit_all_gathers"] is False for u in units)
        else:
            names = [u["name"].removesuffix("._checkpoint_wrapped_module") for u in units]
            assert names == ["", "net.blocks.0", "net.blocks.1", "net.blocks.2"]
            assert units[0]["unsharded_numel"] == FEATURES_HEAD
    else:
        init = {}
        cfg = {"strategy": strategy, "manual_wrap": True, "reference": True, "epochs": 1}
        run = scenario(cfg, script="fabric_loop.py")
        got, reference = run.final(), run.final()["reference"]
        assert run.rank(0)["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        names = [name.removesuffix("._checkpoint_wrapped_module") for name in run.rank(1)["units"]]
        assert names == ["", "net.blocks.0", "net.blocks.1", "net.blocks.2"]
    # what stays plain on every rank (and equal, the harness checks): the buffer only; the head is sharded
    assert list(torch.load(run.out / "replicated0.pt", weights_only=True)) == (["net.scale"] if init else [])
    assert_close_weights(got["weights"], reference["weights"], atol=1e-5)
    if door == "trainer":
        initial = scenario({"strategy": "reference", "max_steps": 0, "module": init}).final()["weights"]
    else:
        initial = got["initial"]
    assert not torch.allclose(initial["head.weight"], got["weights"]["head.weight"])  # the head trained


# which threads torch leaves running, and how it names them, moves with torch: the version jobs run the Trainer's case
# (the teardown both doors share, _exit.close_all); the Fabric loop's case runs in the default job
@pytest.mark.parametrize("door", [pytest.param("trainer", marks=pytest.mark.versions), "fabric"])
def test_a_plain_script_that_saves_after_fit_exits_0_with_nothing_left_running(scenario, tmp_path, door):
    """A user's script: ``Trainer.fit`` (or a Fabric loop, which is never torn down) with FSDP2, then a save, then the
    interpreter's own exit (no ``destroy_process_group``, no ``os._exit``) under Lightning's launcher. Whatever the
    package started is closed before Python shuts down: a process group, a heartbeat, the preemption watcher or a gloo
    worker still busy there aborted such scripts at exit now and then (``terminate called without an active
    exception``, exit code 134) after their checkpoint was written. The script's last collective is made to finish
    late on gloo's worker (a completion callback), which aborted every time before the exit waited for the workers.
    FSDP1 on a torch without the FSDP2 engine (torch 2.6/2.7: what is closed at exit does not depend on the engine)."""
    from lightning_gaudi_fsdp import _compat

    ckpt = tmp_path / "last.ckpt"
    engine = 2 if _compat.FSDP2_FORCE_SUM_REDUCTION else 1
    strategy = {"fsdp_version": engine, "auto_wrap_policy": [BLOCK], "state_dict_type": "sharded"}
    cfg = {"strategy": strategy, "exit_normally": True, "late_collective": True}
    if door == "trainer":
        cfg.update(max_steps=2, save_path=str(ckpt))
    else:
        cfg.update(epochs=1, save=str(ckpt), save_after_epoch=1)
    run = scenario(
        cfg,
        script="train.py" if door == "trainer" else "fabric_loop.py",
        launcher="lightning",  # a plain `python script.py`; the scenario pool ends its ranks with os._exit
        expect_ok=False,
    )
    assert "terminate called" not in run.proc.stderr, run.proc.stderr[-3000:]
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    assert (ckpt / ".metadata").is_file()
    for rank in (0, 1):
        left = json.loads((run.out / f"exit{rank}.json").read_text())
        assert left == {"process_group": False, "threads": []}, f"rank {rank} left running at exit: {left}"
