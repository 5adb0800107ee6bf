"""The examples users start from, and LightningCLI configs: each runs for real with 2 CPU processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "examples" / "llama_fsdp.py"
REHEARSAL = ROOT / "examples" / "configs" / "llama_cpu_rehearsal.yaml"


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    from conftest import run_command

    return run_command([sys.executable, *args], cwd=cwd, timeout=timeout)


def test_toy_example_trains_on_two_cpu_processes(tmp_path):
    proc = _run([str(ROOT / "examples" / "toy_example.py"), "--iterations", "3", "--ws", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Running on CPU processes (gloo), no Gaudi found with 2 processes" in proc.stdout
    assert "rank 0: All done" in proc.stdout
    assert "rank 1: All done" in proc.stdout


@pytest.mark.versions
def test_llama_rehearsal_loss_falls(tmp_path):
    proc = _run([str(LLAMA), "fit", "--config", str(REHEARSAL), "--trainer.max_steps", "40"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("accelerator=auto: training on CPU processes (no Gaudi found)") == 1  # not per rank
    # activation checkpointing inside LlamaForCausalLM: the KV cache is off in training (transformers 4.x needs it)
    assert re.search(r"KV cache in training +: off in model, model.model \(activation checkpointing\)", proc.stderr)
    match = re.search(r"loss: first=([\d.]+) last=([\d.]+) steps=40", proc.stdout)
    assert match, proc.stdout[-2000:]
    first, last = map(float, match.groups())
    assert last < 0.6 * first
    # what the run leaves: metrics, a loss curve and a sharded checkpoint written in the background, committed
    from lightning_gaudi_fsdp.checkpoint.convert import describe

    run_dir = tmp_path / "runs" / "llama" / "logs" / "version_0"
    assert (run_dir / "metrics.csv").read_text().startswith(("epoch", "lr", "step", "train_loss", "val_loss"))
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last_ckpt = run_dir / "checkpoints" / "last.ckpt"
    info = describe(last_ckpt)
    assert (info["format"], info["global_step"], info["world_size"]) == ("sharded", 30, 2)  # every 30 steps
    assert f"lightning-gaudi-fsdp inspect {last_ckpt.relative_to(tmp_path)}" in proc.stdout


def test_print_config_round_trips(tmp_path):
    printed = _run([str(LLAMA), "fit", "--config", str(REHEARSAL), "--print_config"], tmp_path)
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = tmp_path / "printed.yaml"
    config.write_text(printed.stdout)
    again = _run([str(LLAMA), "fit", "--config", str(config), "--print_config"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert yaml.safe_load(again.stdout) == yaml.safe_load(printed.stdout)
    strategy = yaml.safe_load(printed.stdout)["trainer"]["strategy"]["init_args"]
    assert strategy["sharding_strategy"] == "full_shard"
    assert strategy["state_dict_type"] == "sharded"
    # ...and the printed config trains
    run = _run(
        [str(LLAMA), "fit", "--config", str(config), "--trainer.max_steps", "3", "--trainer.val_check_interval", "3"],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "steps=3" in run.stdout


def _with_strategy(tmp_path: Path, strategy: object) -> Path:
    config = yaml.safe_load(REHEARSAL.read_text())
    config["trainer"]["strategy"] = strategy
    config["trainer"]["max_steps"] = 2
    config["trainer"]["val_check_interval"] = 2
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("init_args", "message"),
    [
        ({"sharding_strategy": "full"}, "sharding_strategy='full' is not supported; expected one of 'FULL_SHARD'"),
        (
            {"auto_wrap_policy": ["transformers.models.llama.modeling_llama.LlamaDecoderLayr"]},
            "has no attribute 'LlamaDecoderLayr'; did you mean",
        ),
        ({"limit_all_gather": True}, "limit_all_gather"),
        ({"mixed_precision": {"param_dtype": "bfloat17"}}, "mixed_precision['param_dtype']='bfloat17'"),
    ],
)
def test_config_mistakes_fail_before_any_process_starts(tmp_path, init_args, message):
    config = _with_strategy(tmp_path, {"class_path": "lightning_gaudi_fsdp.GaudiFSDPStrategy", "init_args": init_args})
    proc = _run([str(LLAMA), "fit", "--config", str(config)], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr


def test_strategy_by_registered_name(tmp_path):
    config = _with_strategy(tmp_path, "gaudi_fsdp")
    proc = _run([str(LLAMA), "fit", "--config", str(config)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GaudiFSDPStrategy configuration" in proc.stdout + proc.stderr


def test_fabric_pretrain_saves_sharded_checkpoints_and_resumes(tmp_path):
    script = str(ROOT / "examples" / "fabric_pretrain.py")
    first = _run([script, "--steps", "20", "--save-every", "10", "--async-save"], tmp_path)  # committed by teardown
    assert first.returncode == 0, first.stderr[-3000:]
    assert "training on CPU processes (no Gaudi found)" in first.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00010", "step-00020"]
    assert (tmp_path / "checkpoints" / "step-00020" / "meta.pt").is_file()  # the sharded layout
    resumed = _run([script, "--steps", "30", "--save-every", "10", "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoints/step-00020 at step 20" in resumed.stdout
    losses = [re.search(r"loss: first=([\d.]+) last=([\d.]+) steps=(\d+)", run.stdout) for run in (first, resumed)]
    assert all(losses), first.stdout[-2000:] + resumed.stdout[-2000:]
    (start, mid, steps20), (again, end, steps30) = (m.groups() for m in losses)
    assert (steps20, steps30) == ("20", "30")
    assert float(mid) < 0.8 * float(start)
    assert float(end) < 0.8 * float(start)
    assert float(again) < 0.8 * float(start)  # the resumed run starts from the trained weights
