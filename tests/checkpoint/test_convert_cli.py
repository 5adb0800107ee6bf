"""Offline tools on real checkpoints written by 2-rank FSDP runs: inspect, convert, and loading the results."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint.convert import describe
from lightning_gaudi_fsdp.cli import main

PARAMS = 3 * (16 * 16 + 16 + 16 + 16) + 17  # three blocks and the head of tests/scenarios/common.Net


# the module's three runs (180 s each) set up inside whichever test comes first; one test waits 300 s for Lightning's
# consolidate_checkpoint
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-rank run per format; each saves its checkpoint after training and its final full weights."""
    from conftest import run_script

    runs = {}
    for fmt in ("full", "sharded", "local"):
        tmp = tmp_path_factory.mktemp(fmt)
        ckpt = tmp / f"model-{fmt}.ckpt"
        cfg = {
            "strategy": {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt},
            "max_steps": 3,
            "save_path": str(ckpt),
            "module": {"n_samples": 64},
        }
        runs[fmt] = (ckpt, run_script("train.py", cfg, tmp).final())
    return runs


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``lightning-gaudi-fsdp ARGS`` run in this process (the command's ``main``: what it prints and the exit status
    it returns); the command needs no process group, so only one case pays for a fresh interpreter
    (``_cli_process``)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exited:  # argparse's usage errors
            code = exited.code if isinstance(exited.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _cli_process(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_gaudi_fsdp", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.versions
@pytest.mark.parametrize("fmt", ["full", "sharded", "local"])
def test_inspect_describes_each_format(saved, fmt):
    ckpt, _ = saved[fmt]
    info = describe(ckpt)
    assert info["format"] == fmt
    assert info["parameters"] == PARAMS
    assert info["bytes"] == PARAMS * 4
    assert info["dtypes"] == {"float32": PARAMS}
    assert info["global_step"] == 3
    assert info["optimizer"] is True
    assert info["world_size"] == (None if fmt == "full" else 2)
    out = _cli("inspect", str(ckpt))
    assert out.returncode == 0, out.stderr
    assert re.search(rf"^format\s+{fmt}$", out.stdout, re.M)
    assert re.search(r"^engine \(writer\)\s+FSDP1$", out.stdout, re.M)
    assert re.search(rf"^parameters\s+{PARAMS:,}$", out.stdout, re.M)
    writers = "any (full file)" if fmt == "full" else "2"  # recorded by the 2 ranks that wrote it
    assert re.search(rf"^world size \(writer\)\s+{re.escape(writers)}$", out.stdout, re.M)


def _world_size_row(ckpt) -> str:
    out = _cli("inspect", str(ckpt))
    assert out.returncode == 0, out.stderr
    return next(row for row in out.stdout.splitlines() if row.startswith("world size (writer)")).split(None, 3)[-1]


def test_inspect_says_unknown_for_a_sharded_checkpoint_without_the_writers_world_size(saved, tmp_path):
    """A sharded checkpoint from before the world size was recorded: its two shard files say nothing about how many
    ranks wrote it (a writer may leave some ranks without a file, or write them all from one process)."""
    ckpt = tmp_path / "old.ckpt"
    shutil.copytree(saved["sharded"][0], ckpt)
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    assert meta.pop("gaudi_fsdp_world_size") == 2
    torch.save(meta, ckpt / "meta.pt")
    (ckpt / "checksums.json").unlink()  # releases that recorded no world size recorded no checksums either
    assert len(list(ckpt.glob("*.distcp"))) == 2
    assert describe(ckpt)["world_size"] is None
    assert _world_size_row(ckpt) == "unknown"


def _plain_module_output(checkpoint_path) -> torch.Tensor:
    sys.path.insert(0, str(__import__("conftest").SCENARIOS))
    from common import Module

    module = Module()
    ckpt = torch.load(checkpoint_path, weights_only=False)
    module.load_state_dict(ckpt["state_dict"])  # the plain, unwrapped LightningModule
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    return module(x)


def _reference_output(weights) -> torch.Tensor:
    from common import Net

    net = Net()
    net.load_state_dict(weights)
    return net(torch.randn(5, 16, generator=torch.Generator().manual_seed(3)))


@pytest.mark.versions
@pytest.mark.parametrize("src_fmt", ["local", "sharded"])
def test_convert_to_full_loads_into_the_plain_module(saved, tmp_path, src_fmt):
    ckpt, final = saved[src_fmt]
    dst = tmp_path / "full.ckpt"
    out = _cli("convert", str(ckpt), str(dst), "--to", "full")
    assert out.returncode == 0, out.stderr
    assert dst.is_file()
    torch.testing.assert_close(_plain_module_output(dst), _reference_output(final["weights"]), atol=0, rtol=0)
    converted = torch.load(dst, weights_only=False)
    assert converted["global_step"] == 3
    assert converted["optimizer_states"][0]["state"]  # keyed by parameter name, joined from the ranks' slices
    assert "not converted" not in out.stderr


@pytest.mark.versions
@pytest.mark.parametrize("src_fmt", ["full", "local"])
def test_convert_to_sharded_then_load_on_two_ranks(saved, tmp_path, scenario, src_fmt):
    ckpt, final = saved[src_fmt]
    dst = tmp_path / "sharded.ckpt"
    out = _cli("convert", str(ckpt), str(dst), "--to", "sharded")
    assert out.returncode == 0, out.stderr
    assert describe(dst)["format"] == "sharded"
    # one process wrote whole tensors for any number of ranks: no writer's world size applies
    assert _world_size_row(dst) == "unknown"
    # Resume at max_steps=3: the run only loads; its weights must be the converted ones.
    loaded = scenario(
        {"strategy": {"auto_wrap_policy": [BLOCK]}, "max_steps": 3, "ckpt_path": str(dst), "module": {"n_samples": 64}}
    ).final()
    for key, value in final["weights"].items():
        assert torch.equal(loaded["weights"][key], value), key
    # AdamW moments and step counts travel through the conversion, keyed by parameter name
    assert loaded["optimizer"]["state"]
    torch.testing.assert_close(loaded["optimizer"]["state"], final["optimizer"]["state"], atol=0, rtol=0)
    assert loaded["lr"] == final["lr"]


def test_cli_errors_are_one_line_with_exit_code_2(saved, tmp_path):
    out = _cli_process("inspect", str(tmp_path / "nope.ckpt"))  # the installed command, in its own process
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "nope.ckpt" in out.stderr
    assert "no such file or directory" in out.stderr
    (tmp_path / "empty").mkdir()
    out = _cli("inspect", str(tmp_path / "empty"))
    assert out.returncode == 2
    assert "neither 'local_metadata.json' (local) nor 'meta.pt' (sharded)" in out.stderr
    ckpt, _ = saved["full"]
    existing = tmp_path / "exists.ckpt"
    shutil.copy(ckpt, existing)
    before = existing.read_bytes()
    out = _cli("convert", str(ckpt), str(existing), "--to", "full")
    assert out.returncode == 2
    assert "already exists" in out.stderr
    assert existing.read_bytes() == before  # nothing the user had is lost


def test_lightning_consolidate_checkpoint_reads_our_sharded_format(saved, tmp_path):
    ckpt, final = saved["sharded"]
    src = tmp_path / "sharded.ckpt"
    shutil.copytree(ckpt, src)
    out = subprocess.run(
        [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    consolidated = tmp_path / "sharded.ckpt.consolidated"
    torch.testing.assert_close(_plain_module_output(consolidated), _reference_output(final["weights"]), atol=0, rtol=0)
