"""Launching beyond one machine: two torchrun "nodes" on loopback, and a SLURM-style environment."""

from __future__ import annotations

import json
import subprocess
import sys

import lightning as L
import torch

from helpers import BLOCK, free_port, slurm_environment
from lightning_gaudi_fsdp import GaudiFSDPStrategy


def _two_nodes(
    cfg: dict, tmp_path, timeout: float = 180, per_node: int = 1, expect_ok: bool = True
) -> list[subprocess.CompletedProcess[str]]:
    """One torchrun agent per node (node_rank 0 and 1), ``per_node`` processes each, rendezvous on loopback."""
    from conftest import SCENARIOS, run_commands

    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(cfg))
    port = free_port()
    cmds = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            str(per_node),
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(SCENARIOS / "train.py"),
            str(cfg_file),
        ]
        for node in (0, 1)
    ]
    results = run_commands(cmds, SCENARIOS, timeout)
    if expect_ok:
        for result in results:
            assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return results


def _cfg(tmp_path, name: str, strategy: dict, devices: int = 1, **extra) -> dict:
    out = tmp_path / name
    return {
        "out": str(out),
        "devices": devices,
        "trainer": {"num_nodes": 2},
        "strategy": strategy,
        "max_steps": 3,
        "module": {"n_samples": 64},
        **extra,
    }


def _rank(tmp_path, name: str, rank: int) -> dict:
    return json.loads((tmp_path / name / f"rank{rank}.json").read_text())


def test_two_torchrun_nodes_hybrid_shard_on_a_nodes_by_devices_mesh(tmp_path):
    strategy = {"sharding_strategy": "HYBRID_SHARD", "device_mesh": [2, 2], "auto_wrap_policy": [BLOCK]}
    _two_nodes(_cfg(tmp_path, "hybrid", strategy, devices=2), tmp_path, per_node=2)
    for rank in range(4):
        info = _rank(tmp_path, "hybrid", rank)
        assert info["world_size"] == 4
        assert info["units"][0]["sharding_strategy"] == "HYBRID_SHARD"
        # sharded across the 2 devices of a node, replicated across the 2 nodes
        assert all(
            u["local_numel"] * 2 >= u["unsharded_numel"] > u["local_numel"] for u in info["units"] if "local_numel" in u
        )


def test_two_torchrun_nodes_full_shard_save_and_reload_sharded(tmp_path):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "sharded"}
    ckpt = tmp_path / "ckpt"
    _two_nodes(_cfg(tmp_path, "save", strategy, save_path=str(ckpt)), tmp_path)
    for rank in (0, 1):
        units = [u for u in _rank(tmp_path, "save", rank)["units"] if "local_numel" in u]
        assert all(u["local_numel"] * 2 >= u["unsharded_numel"] > u["local_numel"] for u in units)
    saved = torch.load(tmp_path / "save" / "final.pt", weights_only=False)
    _two_nodes(_cfg(tmp_path, "load", strategy, ckpt_path=str(ckpt)), tmp_path)
    loaded = torch.load(tmp_path / "load" / "final.pt", weights_only=False)
    assert loaded["step"] == 3
    for key, value in saved["weights"].items():
        assert torch.equal(loaded["weights"][key], value), key


def test_a_rank_lost_on_another_node_is_named_by_its_stalled_heartbeat(tmp_path):
    # Rank 1 runs under the other agent ("node 1"): rank 0 cannot check its process, only its heartbeat.
    cfg = _cfg(tmp_path, "lost", {"auto_wrap_policy": [BLOCK], "timeout": 60}, max_steps=6)
    cfg["module"]["fail"] = {"where": "training_step", "rank": 1, "step": 3, "kind": "sigkill"}
    node0, node1 = _two_nodes(cfg, tmp_path, expect_ok=False)
    assert node0.returncode != 0
    assert node1.returncode != 0
    assert "lightning_gaudi_fsdp: rank 1 of 2 stopped without reporting an error" in node0.stderr


def test_slurm_environment_resolves_ranks(monkeypatch):
    slurm_environment(monkeypatch, tasks=4, tasks_per_node=2, rank=3, nodelist="node[01-02]")
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=GaudiFSDPStrategy(), logger=False)
    strategy = trainer.strategy
    assert type(strategy.cluster_environment).__name__ == "SLURMEnvironment"
    strategy.set_world_ranks()
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size) == (3, 1, 1, 4)
    assert strategy.cluster_environment.main_address == "node01"
