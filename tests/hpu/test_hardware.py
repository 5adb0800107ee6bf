"""The CPU suite's scenarios on real Gaudi devices: ``pytest -m hpu`` on a Gaudi machine (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from helpers import BLOCK

pytestmark = pytest.mark.hpu


ENGINES = pytest.mark.parametrize("engine", [1, 2])


@ENGINES
def test_two_cards_train_with_hccl_in_eager_mode(scenario, engine):
    strategy = {"auto_wrap_policy": [BLOCK], "fsdp_version": engine}
    run = scenario({"accelerator": "hpu", "strategy": strategy, "max_steps": 4})
    info = run.rank(0)
    assert info["backend"] == "hccl"
    if engine == 1:
        assert all(u["compute_device"].startswith("hpu") for u in info["units"])
    else:
        assert info["engine"] == 2  # FSDP2 reduce-scatters with SUM on hccl (HCCL has no AVG)
    assert info["losses"][-1] < info["losses"][0]


@ENGINES
def test_bf16_mixed_autocasts_on_hpu(scenario, engine):
    run = scenario(
        {
            "accelerator": "hpu",
            "strategy": {"auto_wrap_policy": [BLOCK], "fsdp_version": engine},
            "trainer": {"precision": "bf16-mixed"},
            "max_steps": 2,
        }
    )
    assert run.rank(0)["seen_dtypes"]["training_step_matmul"] == "torch.bfloat16"
    assert run.rank(0)["seen_dtypes"]["training_step_fp32_matmul"] == "torch.bfloat16"


@ENGINES
@pytest.mark.parametrize(
    ("fmt", "cpu_offload"),
    # offloaded shards sit in host memory, which hccl does not carry: their full state goes through torch's gather
    [("full", False), ("sharded", False), ("local", False), ("full", True)],
)
def test_save_and_resume_each_format_on_hpu(scenario, tmp_path, fmt, cpu_offload, engine):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine, "cpu_offload": cpu_offload}
    module = {"n_samples": 32, "batch_size": 4}
    straight = scenario({"accelerator": "hpu", "strategy": strategy, "module": module, "max_steps": 8}).final()
    ckpt = tmp_path / "ckpt"
    scenario(
        {
            "accelerator": "hpu",
            "strategy": strategy,
            "module": module,
            "max_steps": 4,
            "save_at_step": 4,
            "save_path_in_loop": str(ckpt),
        }
    )
    resumed = scenario(
        {"accelerator": "hpu", "strategy": strategy, "module": module, "max_steps": 8, "ckpt_path": str(ckpt)}
    ).final()
    assert resumed["step"] == straight["step"] == 8
    for key, value in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], value)


@ENGINES
def test_sync_module_states_gives_every_card_rank_zero_weights(scenario, engine):
    """The model is still on the host when its states are synchronised; Intel's hccl carries hpu tensors only (FSDP2
    broadcasts them over a gloo group, FSDP1 on the device)."""
    run = scenario(
        {
            "accelerator": "hpu",
            "strategy": {"auto_wrap_policy": [BLOCK], "sync_module_states": True, "fsdp_version": engine},
            "module": {"rank_dependent_init": True},
            "max_steps": 1,
        }
    )
    assert run.rank(0)["initial_unique_values"] == [0.01]


@ENGINES
def test_compile_uses_hpu_backend(scenario, engine):
    run = scenario(
        {
            "accelerator": "hpu",
            "strategy": {"auto_wrap_policy": [BLOCK], "compile": True, "fsdp_version": engine},
            "max_steps": 2,
            "probes": ["dynamo"],
        }
    )
    assert run.rank(0)["dynamo_frames_ok"] > 0


def test_async_save_stages_off_the_device_into_pinned_host_buffers():
    from lightning_gaudi_fsdp import gaudi
    from lightning_gaudi_fsdp.checkpoint.staging import HostStager

    device = gaudi.current_device()
    weight = torch.arange(12.0, device=device).reshape(3, 4)
    stager = HostStager(gaudi.host_staging_allocator(device.type))
    staged = stager.stage({"state_dict": {"weight": weight}})["state_dict"]["weight"]
    assert staged.device.type == "cpu"
    assert staged.is_pinned()
    assert torch.equal(staged, torch.arange(12.0).reshape(3, 4))
    pointer = staged.data_ptr()
    weight.add_(1)
    again = stager.stage({"state_dict": {"weight": weight}})["state_dict"]["weight"]
    assert again.data_ptr() == pointer  # the next save reuses the pinned buffer
    assert torch.equal(again, torch.arange(12.0).reshape(3, 4) + 1)


# ------------------------------------------------------------------------------------------------- Lightning Fabric
FABRIC = "fabric_loop.py"


@ENGINES
def test_fabric_loop_trains_on_two_cards_like_one_process(scenario, engine):
    """The Fabric loop (accumulation under no_backward_sync, clipping by the global norm) on 2 cards over hccl, against
    the same model trained on the whole global batch on the host CPU."""
    strategy = {"auto_wrap_policy": [BLOCK], "fsdp_version": engine}
    run = scenario({"accelerator": "hpu", "strategy": strategy, "reference": True, "clip_norm": 0.1}, script=FABRIC)
    info, reference = run.rank(0), run.final()["reference"]
    assert info["backend"] == "hccl"
    assert info["device"].startswith("hpu")
    assert info["all_reduce_mean"] == 1.5  # a SUM divided by the group size: HCCL has no AVG
    assert info["losses"] == pytest.approx(reference["losses"], abs=1e-4)
    assert "GaudiFSDPStrategy configuration:" in run.proc.stdout + run.proc.stderr


@ENGINES
@pytest.mark.parametrize("background", [False, True])
def test_fabric_sharded_save_and_resume_on_hpu(scenario, tmp_path, engine, background):
    strategy = {"auto_wrap_policy": [BLOCK], "fsdp_version": engine, "state_dict_type": "sharded"}
    strategy["async_save"] = background
    ckpt = tmp_path / "ckpt"
    common = {"accelerator": "hpu", "strategy": strategy, "epochs": 2}
    straight = scenario({**common, "save": str(ckpt), "save_after_epoch": 1}, script=FABRIC).final()
    resumed = scenario({**common, "load": str(ckpt)}, script=FABRIC).final()
    for key, value in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], value)
    assert resumed["scheduler"] == straight["scheduler"]


def test_fabric_names_a_rank_that_raises_on_hpu(scenario):
    run = scenario(
        {
            "accelerator": "hpu",
            "strategy": {"auto_wrap_policy": [BLOCK], "timeout": 60},
            "fail": {"rank": 1, "step": 2},
            "epochs": 2,
        },
        script=FABRIC,
        expect_ok=False,
        timeout=150,
    )
    assert run.proc.returncode != 0
    assert "lightning_gaudi_fsdp: rank 1 failed first with: RuntimeError: boom in training_step on rank 1" in (
        run.proc.stderr
    )
