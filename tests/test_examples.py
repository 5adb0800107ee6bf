"""The examples users start from, and LightningCLI configs: each runs for real with 2 CPU processes."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "examples" / "llama_fsdp.py"
REHEARSAL = ROOT / "examples" / "configs" / "llama_cpu_rehearsal.yaml"


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    from conftest import run_command

    return run_command([sys.executable, *args], cwd=cwd, timeout=timeout)


def _assert_epochs_shown(output: str, last: int) -> None:
    """The progress bar counts epochs up to the last one the run trains: a step-bounded run with Lightning's default
    ``max_epochs=-1`` shows "Epoch 0/-2" (Rich's bar shows ``/last``; Lightning's TQDM bar, without rich, none)."""
    shown = re.findall(r"Epoch (\d+)/(-?\d+)", output)
    assert shown or re.search(r"Epoch 0\b", output), output[-2000:]
    assert {total for _, total in shown} <= {str(last)}, shown


def test_toy_example_trains_on_two_cpu_processes(tmp_path):
    proc = _run([str(ROOT / "examples" / "toy_example.py"), "--iterations", "3", "--ws", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_epochs_shown(proc.stdout, last=0)
    assert "Running on CPU processes (gloo), no Gaudi found with 2 processes" in proc.stdout
    assert "rank 0: All done" in proc.stdout
    assert "rank 1: All done" in proc.stdout


@pytest.fixture(scope="module")
def llama_example():
    """The LLaMA example imported into this process, for the checks that end before anything is launched (printing
    and instantiating a config): they need no processes, so they cost an import, not a launch."""
    spec = importlib.util.spec_from_file_location("llama_fsdp_example", LLAMA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _print_config(example, config: Path, capsys) -> str:
    with pytest.raises(SystemExit) as exited, _argv():  # jsonargparse prints the config and exits during parsing
        example.main(["fit", "--config", str(config), "--print_config"])
    assert exited.value.code in (0, None)
    return capsys.readouterr().out


def _instantiate(example, config: Path) -> object:
    """What ``fit --config`` builds, without running it (``run=False``: no launch, no process group)."""
    with _argv():
        return example.GaudiCLI(
            example.LlamaLM,
            example.StrideDataModule,
            args=["--config", str(config)],
            run=False,
            save_config_callback=None,
        )


@contextlib.contextmanager
def _argv() -> Iterator[None]:
    """The example's own command line while it parses ``args`` (LightningCLI warns when pytest's is there too), and
    this process's environment as it was afterwards."""
    saved, environ = sys.argv, dict(os.environ)
    sys.argv = [str(LLAMA)]
    try:
        yield
    finally:
        sys.argv = saved
        os.environ.clear()  # LightningCLI's seed_everything sets PL_GLOBAL_SEED, which later scenarios would inherit
        os.environ.update(environ)


@pytest.mark.versions
def test_llama_rehearsal_trains_from_its_printed_config_and_loss_falls(tmp_path, llama_example, capsys):
    # --print_config round trips: printing the printed config gives the same config
    printed = _print_config(llama_example, REHEARSAL, capsys)
    config = tmp_path / "printed.yaml"
    config.write_text(printed)
    assert yaml.safe_load(_print_config(llama_example, config, capsys)) == yaml.safe_load(printed)
    strategy = yaml.safe_load(printed)["trainer"]["strategy"]["init_args"]
    assert strategy["sharding_strategy"] == "full_shard"
    assert strategy["state_dict_type"] == "sharded"
    # ...and the printed config trains: the README's main job, launched for real on 2 CPU processes
    proc = _run([str(LLAMA), "fit", "--config", str(config), "--trainer.max_steps", "40"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("accelerator=auto: training on CPU processes (no Gaudi found)") == 1  # not per rank
    assert "GaudiFSDPStrategy configuration" in proc.stdout + proc.stderr
    # activation checkpointing inside LlamaForCausalLM: the KV cache is off in training (transformers 4.x needs it)
    assert re.search(r"KV cache in training +: off in model, model.model \(activation checkpointing\)", proc.stderr)
    match = re.search(r"loss: first=([\d.]+) last=([\d.]+) steps=40", proc.stdout)
    assert match, proc.stdout[-2000:]
    _assert_epochs_shown(proc.stdout, last=0)  # the 40 steps take part of the config's one epoch
    first, last = map(float, match.groups())
    assert last < 0.6 * first
    # throughput: tokens/s measured; MFU not available on CPU, with the reason (on Gaudi it is logged: test_throughput)
    assert re.search(
        r"throughput: \d+ tokens/s on 2 device\(s\); MFU not available: no published peak FLOPs for 'cpu' devices",
        proc.stdout,
    ), proc.stdout[-2000:]
    # what the run leaves: metrics, a loss curve and a sharded checkpoint written in the background, committed
    from lightning_gaudi_fsdp.checkpoint.convert import describe

    run_dir = tmp_path / "runs" / "llama" / "logs" / "version_0"
    metrics_csv = (run_dir / "metrics.csv").read_text()
    assert metrics_csv.startswith(("epoch", "lr", "step", "train_loss", "val_loss", "train/"))
    assert "train/items_per_sec" in metrics_csv.splitlines()[0]  # tokens/s, logged by ThroughputMonitor
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last_ckpt = run_dir / "checkpoints" / "last.ckpt"
    info = describe(last_ckpt)
    assert (info["format"], info["global_step"], info["world_size"]) == ("sharded", 30, 2)  # every 30 steps
    assert f"lightning-gaudi-fsdp inspect {last_ckpt.relative_to(tmp_path)}" in proc.stdout


def _with_strategy(tmp_path: Path, strategy: object) -> Path:
    config = yaml.safe_load(REHEARSAL.read_text())
    config["trainer"]["strategy"] = strategy
    config["trainer"]["max_steps"] = 2
    config["trainer"]["val_check_interval"] = 2
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


CONFIG_MISTAKES = [
    ({"sharding_strategy": "full"}, "sharding_strategy='full' is not supported; expected one of 'FULL_SHARD'"),
    (
        {"auto_wrap_policy": ["transformers.models.llama.modeling_llama.LlamaDecoderLayr"]},
        "has no attribute 'LlamaDecoderLayr'; did you mean",
    ),
    ({"limit_all_gather": True}, "limit_all_gather"),
    ({"mixed_precision": {"param_dtype": "bfloat17"}}, "mixed_precision['param_dtype']='bfloat17'"),
]


def test_a_config_mistake_fails_the_real_command_before_any_process_starts(tmp_path):
    init_args, message = CONFIG_MISTAKES[0]
    config = _with_strategy(tmp_path, {"class_path": "lightning_gaudi_fsdp.GaudiFSDPStrategy", "init_args": init_args})
    proc = _run([str(LLAMA), "fit", "--config", str(config)], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(("init_args", "message"), CONFIG_MISTAKES)
def test_config_mistakes_are_refused_while_the_config_is_instantiated(
    tmp_path, llama_example, capsys, init_args, message
):
    config = _with_strategy(tmp_path, {"class_path": "lightning_gaudi_fsdp.GaudiFSDPStrategy", "init_args": init_args})
    with pytest.raises((SystemExit, ValueError, TypeError)) as refused:
        _instantiate(llama_example, config)
    assert message in capsys.readouterr().err + str(refused.value)


def test_strategy_by_registered_name(tmp_path, llama_example):
    from lightning_gaudi_fsdp import GaudiFSDPStrategy

    cli = _instantiate(llama_example, _with_strategy(tmp_path, "gaudi_fsdp"))
    assert type(cli.trainer.strategy) is GaudiFSDPStrategy
    assert cli.trainer.num_devices == 2


def test_fabric_pretrain_saves_sharded_checkpoints_and_resumes(tmp_path):
    script = str(ROOT / "examples" / "fabric_pretrain.py")
    first = _run([script, "--steps", "20", "--save-every", "10", "--async-save"], tmp_path)  # committed by teardown
    assert first.returncode == 0, first.stderr[-3000:]
    assert "training on CPU processes (no Gaudi found)" in first.stdout
    # Fabric's throughput monitor: tokens/s, and on CPU the reason there is no MFU
    assert re.search(
        r"throughput: \d+ tokens/s on 2 device\(s\); MFU not available: no published peak FLOPs for 'cpu' devices",
        first.stdout,
    ), first.stdout[-2000:]
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


def test_finetune_hf_round_trip_loads_lora_trains_and_exports(tmp_path):
    proc = _run([str(ROOT / "examples" / "finetune_hf.py"), "--steps", "24"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"CPU processes \(no Gaudi found\): loss: first=([\d.]+) last=([\d.]+) steps=24", proc.stdout)
    assert match, proc.stdout[-2000:]
    _assert_epochs_shown(proc.stdout, last=0)  # 24 steps of 32 per epoch (64 batches shared by 2 ranks)
    first, last = map(float, match.groups())
    assert last < first  # the adapters learn; the base started from its pretrained weights (first < ln(128) = 4.85)
    assert first < 3.0
    run = tmp_path / "runs" / "finetune"
    assert sorted(p.name for p in (run / "hf-adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (run / "hf-merged" / "config.json").is_file()
    sample = re.search(r"sample from \S+: \[5, 8, 11, 14(, \d+){8}\]", proc.stdout)
    assert sample, proc.stdout[-2000:]
