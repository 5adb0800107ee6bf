"""Crash safety and damaged checkpoints: real processes, real kills, errors on every rank instead of hangs."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import torch

from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint.convert import describe

MODULE = {"n_samples": 64}


def _strategy(fmt: str, **extra):
    return {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "timeout": 30, **extra}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from conftest import run_script

    made = {}
    for fmt in ("full", "sharded", "local"):
        tmp = tmp_path_factory.mktemp(f"good-{fmt}")
        ckpt = tmp / "model.ckpt"
        cfg = {"strategy": _strategy(fmt), "module": MODULE, "max_steps": 2, "save_path": str(ckpt)}
        made[fmt] = (ckpt, run_script("train.py", cfg, tmp).final())
    return made


def _copy(src, tmp_path):
    """A copy without its checksums (as an earlier release wrote it): the checks before a load still refuse
    damage they can see, on every rank (checkpoints with checksums: see the verified-checkpoint tests below)."""
    dst = tmp_path / src.name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    if dst.is_dir():
        (dst / "checksums.json").unlink()
    return dst


def _load_fails(scenario, ckpt, fmt, message, devices=2, module=MODULE):
    run = scenario(
        {"devices": devices, "strategy": _strategy(fmt), "module": module, "max_steps": 4, "ckpt_path": str(ckpt)},
        expect_ok=False,
        timeout=120,
    )
    assert run.proc.returncode != 0
    assert f"Cannot load checkpoint '{ckpt}'" in run.proc.stderr
    assert message in run.proc.stderr, run.proc.stderr[-3000:]
    assert "Restored all states" not in run.proc.stdout + run.proc.stderr
    return run


def test_truncated_full_file(checkpoints, scenario, tmp_path):
    ckpt = _copy(checkpoints["full"][0], tmp_path)
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    _load_fails(scenario, ckpt, "full", "is damaged or truncated")


def test_missing_shard_file(checkpoints, scenario, tmp_path):
    ckpt = _copy(checkpoints["sharded"][0], tmp_path)
    (ckpt / "__1_0.distcp").unlink()
    _load_fails(scenario, ckpt, "sharded", "shard file '__1_0.distcp' is missing")


def test_truncated_shard_file(checkpoints, scenario, tmp_path):
    ckpt = _copy(checkpoints["sharded"][0], tmp_path)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    _load_fails(scenario, ckpt, "sharded", "shard file '__0_0.distcp' is truncated")


def test_missing_dcp_metadata(checkpoints, scenario, tmp_path):
    ckpt = _copy(checkpoints["sharded"][0], tmp_path)
    (ckpt / ".metadata").unlink()
    _load_fails(scenario, ckpt, "sharded", "the distributed-checkpoint metadata (.metadata) is unreadable")


def test_missing_marker_is_not_a_checkpoint(checkpoints, scenario, tmp_path):
    ckpt = _copy(checkpoints["local"][0], tmp_path)
    (ckpt / "local_metadata.json").unlink()
    _load_fails(scenario, ckpt, "local", "has neither 'local_metadata.json' (local) nor 'meta.pt' (sharded)")


def test_local_shard_missing_on_one_rank_fails_on_every_rank(checkpoints, scenario, tmp_path):
    ckpt = _copy(checkpoints["local"][0], tmp_path)
    (ckpt / "rank_00001.pt").unlink()
    run = _load_fails(scenario, ckpt, "local", "the shard of rank 1 is missing (rank_00001.pt) (reported by rank 1)")
    assert run.proc.stderr.count("reported by rank 1") >= 2  # rank 0 raised it too instead of waiting


def test_any_exception_on_one_rank_while_checking_a_load_fails_on_every_rank(checkpoints, scenario, tmp_path):
    """Not only a CheckpointError: whatever one rank raises while checking the checkpoint reaches every rank as one
    error naming that rank and the exception, in bounded time, instead of leaving the others in the agreement's
    gather. Here rank 1's shard holds a number where its model state should be (a TypeError in rank 1's check)."""
    ckpt = _copy(checkpoints["local"][0], tmp_path)
    torch.save({"model": 3}, ckpt / "rank_00001.pt")
    started = time.monotonic()
    problem = "TypeError: argument of type 'int' is not iterable (reported by rank 1)"
    run = _load_fails(scenario, ckpt, "local", problem)
    assert time.monotonic() - started < 60  # the strategy's timeout is 30 s: nobody waited it out
    for rank in (0, 1):  # each rank's own traceback ends with the same error
        stderr = (run.out / f"rank{rank}.stderr").read_text()
        error = re.escape(f"CheckpointError: Cannot load checkpoint '{ckpt}': {problem}")
        line = rf"^\[rank{rank}\]: \S*{error}$"
        assert re.search(line, stderr, re.MULTILINE), f"rank {rank}: {stderr[-3000:]}"


def test_a_local_shard_of_another_size_on_one_rank_is_refused_on_every_rank(checkpoints, scenario, tmp_path):
    """Rank 1's file holds one element fewer of a unit's flat parameter than the layout its metadata records gives that
    rank: the check refuses it on every rank before any weight changes (rank 1 must not reach torch's load path, with
    collectives the others never join)."""
    ckpt = _copy(checkpoints["local"][0], tmp_path)
    shard = torch.load(ckpt / "rank_00001.pt", weights_only=True)
    key = next(k for k in shard["model"] if k.endswith("_flat_param"))
    held = shard["model"][key].numel()
    shard["model"][key] = shard["model"][key][:-1].clone()
    torch.save(shard, ckpt / "rank_00001.pt")
    problem = f"the shard of rank 1 holds {held - 1} elements of {key!r}; this rank holds {held} (reported by rank 1)"
    run = _load_fails(scenario, ckpt, "local", problem)
    assert run.proc.stderr.count("reported by rank 1") >= 2  # rank 0 raised it too


def test_damage_inside_one_ranks_sharded_entry_fails_on_every_rank(checkpoints, scenario, tmp_path):
    """Bytes changed inside one entry of rank 1's DCP file, its size kept (every check before the read passes): the
    read that fills rank 1's shards fails there only, and every rank raises the same error naming the file, as
    torch's ``dcp.load`` does, instead of rank 0 walking on into the next collective alone."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = _copy(checkpoints["sharded"][0], tmp_path)
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    shard = "__1_0.distcp"
    key, info = max(
        ((k, i) for k, i in metadata.storage_data.items() if i.relative_path == shard and k.fqn.startswith("model.")),
        key=lambda entry: entry[1].length,
    )
    data = bytearray((ckpt / shard).read_bytes())
    data[info.offset : info.offset + info.length] = bytes(info.length)  # zeros: no longer a torch.save archive
    (ckpt / shard).write_bytes(bytes(data))
    started = time.monotonic()
    problem = f"shard file {shard!r} is damaged: its entry of {key.fqn!r} at byte {info.offset}"
    run = _load_fails(scenario, ckpt, "sharded", problem)
    assert time.monotonic() - started < 60  # the strategy's timeout is 30 s: nobody waited it out
    for rank in (0, 1):  # each rank's own traceback ends with the same error, reported by rank 1
        stderr = (run.out / f"rank{rank}.stderr").read_text()
        error = re.escape(f"CheckpointError: Cannot load checkpoint '{ckpt}': {problem}")
        line = rf"^\[rank{rank}\]: \S*{error}.*\(reported by rank 1\)$"
        assert re.search(line, stderr, re.MULTILINE), f"rank {rank}: {stderr[-3000:]}"


@pytest.mark.parametrize("fmt", ["full", "sharded", "local"])
def test_checkpoint_of_another_model(checkpoints, scenario, fmt):
    ckpt = checkpoints[fmt][0]
    message = "FSDP wrap layout differs" if fmt == "local" else "it was written for another model"
    _load_fails(scenario, ckpt, fmt, message, module={**MODULE, "depth": 2})


def test_local_checkpoint_at_another_world_size(checkpoints, scenario):
    ckpt = checkpoints["local"][0]
    _load_fails(scenario, ckpt, "local", "saved with world size 2 and this run has world size 1", devices=1)


@pytest.mark.parametrize(
    ("fmt", "victim", "async_save"),
    [
        ("full", 0, False),
        ("sharded", 1, False),
        ("local", 1, False),
        ("sharded", 1, True),
        ("local", 0, True),
        ("full", 0, True),
    ],
)
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(scenario, tmp_path, fmt, victim, async_save):
    """With ``async_save`` the kill hits the background write while training goes on."""
    ckpt = tmp_path / "last.ckpt"
    good = scenario({"strategy": _strategy(fmt), "module": MODULE, "max_steps": 2, "save_path": str(ckpt)}).final()
    assert describe(ckpt)["global_step"] == 2
    # a second run resumes, then dies in the middle of overwriting the same checkpoint
    crashed = scenario(
        {
            "strategy": _strategy(fmt, async_save=async_save),
            "module": MODULE,
            "max_steps": 6,
            "ckpt_path": str(ckpt),
            "save_at_step": 4,
            "save_path_in_loop": str(ckpt),
            "kill_on_save": {"rank": victim, "nth": 1},
        },
        expect_ok=False,
        timeout=150,
    )
    assert crashed.proc.returncode != 0
    # the interrupted write only ever touched the staging sibling (rank 0 removes it when it survives)
    assert {p.name for p in tmp_path.iterdir()} <= {"last.ckpt", ".last.ckpt.partial", "run0", "run1", "run2"}
    assert describe(ckpt)["global_step"] == 2  # the committed checkpoint is the previous one, untouched
    reloaded = scenario({"strategy": _strategy(fmt), "module": MODULE, "max_steps": 2, "ckpt_path": str(ckpt)}).final()
    for key, value in good["weights"].items():
        assert torch.equal(reloaded["weights"][key], value), key


# ------------------------------------------------------------------------------------------ verified checkpoints
DAMAGES = [
    "full_tensor",
    "full_metadata",
    "full_truncated",
    "sharded_tensor",
    "sharded_metadata",
    "sharded_truncated",
    "sharded_missing",
    "sharded_marker_missing",
    "local_tensor",
    "local_metadata",
    "local_truncated",
    "local_missing",
    "local_marker_missing",
    "local_swapped",
]


def _damage_run(tmp_path_factory, fsdp_version):
    from conftest import run_script

    run = run_script("damage.py", {"fsdp_version": fsdp_version}, tmp_path_factory.mktemp(f"damage{fsdp_version}"))
    return run, run.rank(0), run.rank(1)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """One launch, FSDP1: every damage of every format resumed on 2 ranks (see scenarios/damage.py)."""
    return _damage_run(tmp_path_factory, 1)


def _check_refused(run, rank0, rank1, name):
    from lightning_gaudi_fsdp.cli import main as cli

    file = rank0["damaged"][name]
    ckpt = run.out / "ckpts" / f"damaged_{name}"
    messages = []
    for result in (rank0, rank1):
        load = result["loads"][f"damaged_{name}"]
        assert load["error"] is not None, f"{name}: loaded without an error"
        assert load["error"]["type"] == "CheckpointIntegrityError", load["error"]
        assert (
            f"Cannot load checkpoint '{ckpt}': checksum verification failed: file {file!r}" in load["error"]["message"]
        )
        assert "nothing was loaded" in load["error"]["message"]
        assert load["unchanged"], f"{name}: weights or optimizer state changed by a refused load"
        assert load["seconds"] < 30  # the strategy's timeout is 60 s: nobody waited for a peer
        messages.append(load["error"]["message"])
    assert messages[0] == messages[1]  # the same error, naming the rank that found it, on every rank
    return ckpt, file, messages[0], cli


@pytest.mark.parametrize("name", DAMAGES)
def test_a_damaged_checkpoint_is_refused_on_every_rank_before_anything_loads(damaged, name, capsys):
    run, rank0, rank1 = damaged
    ckpt, file, message, cli = _check_refused(run, rank0, rank1, name)
    if name.endswith(("_tensor", "_metadata")):
        assert "does not match: expected xxh3_64 " in message
        assert ", found " in message
    if name == "sharded_tensor":  # the one entry the damaged byte is in
        assert re.search(r"file '__1_0.distcp' entry 'model\.[^']+' \(bytes \d+ to \d+\) does not match", message)
    if name.endswith("_truncated") and not name.startswith("full"):
        assert "is truncated: expected" in message
    if name.endswith("_missing"):
        assert f"file {file!r} is missing" in message
    # offline: the same file named, exit code 3
    capsys.readouterr()
    assert cli(["inspect", "--verify", str(ckpt)]) == 3
    err = capsys.readouterr().err
    assert f"checksum verification failed: file {file!r}" in err


def test_undamaged_checkpoints_verify_and_load_and_unverified_ones_load_with_one_line(damaged, capsys):
    from lightning_gaudi_fsdp.cli import main as cli

    run, rank0, rank1 = damaged
    for result in (rank0, rank1):
        for name in ("full", "sharded", "local", "unverified"):
            assert result["loads"][name]["error"] is None, (name, result["loads"][name])
    stderr = (run.out / "rank0.stderr").read_text()
    unverified = run.out / "ckpts" / "unverified"
    assert stderr.count(f"checkpoint '{unverified}' carries no checksums") == 1
    assert "carries no checksums" not in (run.out / "rank1.stderr").read_text()  # one line, from rank 0
    for name in ("full", "sharded", "local"):
        capsys.readouterr()
        assert cli(["inspect", "--verify", str(run.out / "ckpts" / name)]) == 0
        assert "verified (xxh3_64)" in capsys.readouterr().out
    assert cli(["inspect", "--verify", str(unverified)]) == 0
    assert "none recorded: not verified" in capsys.readouterr().out
    for name in ("sharded", "local"):  # every file of a directory checkpoint is in its manifest
        ckpt = run.out / "ckpts" / name
        listed = json.loads((ckpt / "checksums.json").read_text())["files"]
        assert sorted(listed) == sorted(p.name for p in ckpt.iterdir() if p.name != "checksums.json")


@pytest.fixture(scope="module")
def damaged_fsdp2(tmp_path_factory):
    return _damage_run(tmp_path_factory, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", DAMAGES)
def test_a_damaged_fsdp2_checkpoint_is_refused_on_every_rank(damaged_fsdp2, name):
    _check_refused(*damaged_fsdp2, name)
