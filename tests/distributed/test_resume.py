"""Exact resume: k steps + save + a new process resuming for k more equals 2k steps without stopping.

The scenarios run without Lightning's logger, progress bar and default checkpointing (``QUIET_TRAINER``), except
``test_mid_epoch_resume_in_a_later_epoch_equals_uninterrupted_run``'s default case, which runs on Lightning's defaults.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import BLOCK
from lightning_gaudi_fsdp.checkpoint import integrity
from lightning_gaudi_fsdp.checkpoint.convert import describe
from lightning_gaudi_fsdp.checkpoint.formats import OPTIMIZER_GROUPS_KEY
from scenarios.common import LIGHTNING_DEFAULTS

STEPS_PER_EPOCH = 4  # 32 samples, 4 per rank, 2 ranks: resuming at an epoch boundary replays no batch


def _save_at(step, path):
    return {"save_at_step": step, "save_path_in_loop": str(path)}


def _module(**extra):
    return {"n_samples": 32, "batch_size": 4, **extra}


def _assert_equal_nested(a, b, path="", close=False) -> None:
    """Bitwise equal tensors, or within 1e-5 with ``close``, at every leaf of nested dicts and lists."""
    if isinstance(a, torch.Tensor) and close:
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=0, msg=lambda m: f"{path}: {m}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs: max {(a.float() - b.float()).abs().max()}"
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), f"{path} keys differ"
        for k in a:
            _assert_equal_nested(a[k], b[k], f"{path}.{k}", close)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal_nested(x, y, f"{path}[{i}]", close)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _assert_same_run(resumed: dict, straight: dict) -> None:
    assert resumed["step"] == straight["step"]
    assert resumed["epoch"] == straight["epoch"]
    assert resumed["lr"] == straight["lr"]
    _assert_equal_nested(resumed["weights"], straight["weights"], "weights")  # bitwise
    _assert_equal_nested(resumed["optimizer"], straight["optimizer"], "optimizer")
    _assert_equal_nested(resumed["schedulers"], straight["schedulers"], "schedulers")


VERSIONS = pytest.mark.versions  # the cases CI also runs on the older torch/Lightning pairings
CASES = [
    pytest.param("full", "FULL_SHARD", 1, marks=VERSIONS),
    ("full", "SHARD_GRAD_OP", 1),
    ("full", "NO_SHARD", 1),
    pytest.param("sharded", "FULL_SHARD", 1, marks=VERSIONS),
    ("sharded", "SHARD_GRAD_OP", 1),
    ("sharded", "NO_SHARD", 1),
    pytest.param("local", "FULL_SHARD", 1, marks=VERSIONS),
    ("local", "SHARD_GRAD_OP", 1),
    ("full", "FULL_SHARD", 2),
    pytest.param("sharded", "FULL_SHARD", 2, marks=VERSIONS),
    ("sharded", "SHARD_GRAD_OP", 2),
    pytest.param("local", "FULL_SHARD", 2, marks=VERSIONS),
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2k steps without stopping, run once per training configuration: the checkpoint format plays no part in
    training, so every format's resume compares against the same run."""
    from conftest import run_script

    runs: dict[str, dict] = {}

    def get(strategy: dict, module: dict) -> dict:
        training = {k: v for k, v in strategy.items() if k not in ("state_dict_type", "async_save", "checkpoint_crc32")}
        key = json.dumps([training, module], sort_keys=True)
        if key not in runs:
            cfg = {"strategy": training, "module": module, "max_steps": 2 * STEPS_PER_EPOCH}
            runs[key] = run_script("train.py", cfg, tmp_path_factory.mktemp("straight")).final()
        return runs[key]

    return get


def _checksummed(ckpt: Path) -> list[bool]:
    """For each zip archive of a checkpoint (DCP's ``.distcp`` files aside): whether it carries a CRC32 of each
    record (``zipfile``'s test finds none bad)."""
    files = [ckpt] if ckpt.is_file() else sorted(p for p in ckpt.iterdir() if p.suffix != ".distcp")
    archives = [f for f in files if zipfile.is_zipfile(f)]
    assert archives, files
    return [zipfile.ZipFile(f).testzip() is None for f in archives]


def _streamed(run) -> bool:
    """Whether rank 0 wrote the run's in-loop checkpoint streamed (each tensor received as it was written)."""
    return json.loads((run.out / "saves0.json").read_text())[0]["streamed"]


@pytest.mark.parametrize(("fmt", "sharding", "engine"), CASES)
def test_resume_equals_uninterrupted_run(scenario, tmp_path, uninterrupted, fmt, sharding, engine):
    strategy = {"sharding_strategy": sharding, "auto_wrap_policy": [BLOCK], "state_dict_type": fmt}
    strategy["fsdp_version"] = engine
    # CRC32s in the zip archives only when asked for: torch.load never checks them (the resume below loads either)
    strategy["checkpoint_crc32"] = crc32 = sharding == "SHARD_GRAD_OP"
    k = STEPS_PER_EPOCH
    straight = uninterrupted(strategy, _module())
    ckpt = tmp_path / f"ckpt-{fmt}"
    # one full case with an on_save_checkpoint hook: the state is gathered before the hook sees it, not streamed
    hooked = fmt == "full" and sharding == "SHARD_GRAD_OP"
    # one streamed case where, a step earlier, a save failed while Lightning built the checkpoint (after the model's
    # state was planned for streaming) and then a checkpoint made by hand was passed to strategy.save_checkpoint
    by_hand = tmp_path / "by-hand.ckpt" if (fmt, sharding, engine) == ("full", "FULL_SHARD", 1) else None
    first = scenario(
        {
            "strategy": strategy,
            "module": _module(),
            "max_steps": k,
            "hook_reads_checkpoint": hooked,
            **({"failed_build_then_direct_save": [k - 1, str(by_hand)]} if by_hand else {}),
            **_save_at(k, ckpt),
        }
    )
    if by_hand is not None:  # the plan left unused costs no wait: the hand-made checkpoint is written as given
        for rank in (0, 1):
            failed = json.loads((first.out / f"direct{rank}.json").read_text())["error"]
            assert failed == "this callback's state_dict failed on purpose"
        assert torch.load(by_hand, weights_only=True)["note"] == "made by hand"
        assert not (tmp_path / "by-hand.ckpt.failed").exists()
    assert first.final()["step"] == k
    assert ckpt.is_file() if fmt == "full" else ckpt.is_dir()
    assert set(_checksummed(ckpt)) == {crc32}
    # full checkpoints of a sharded model are streamed (torch's own path gathers NO_SHARD's), unless a hook reads them
    assert _streamed(first) == (fmt == "full" and sharding != "NO_SHARD" and not hooked)
    if hooked:  # the hook saw real values: those of the file
        saw = json.loads((first.out / "hook_saw.json").read_text())["weights_sum"]
        written = torch.load(ckpt, weights_only=True)["state_dict"]
        assert saw == sum(float(v.double().sum()) for v in written.values())
        assert saw != 0.0
    resumed = scenario(
        {
            "strategy": strategy,
            "module": _module(),
            "max_steps": 2 * k,
            "ckpt_path": str(ckpt),
            "restore_note_after_s": 0.0,
        }
    )
    _assert_same_run(resumed.final(), straight)
    assert all(json.loads((resumed.out / f"rank{r}.json").read_text())["gc_enabled"] for r in (0, 1))
    # rank 0 says what it restored, how much and how fast (by default only for a restore of 5 s or more)
    notes = re.findall(r"lightning_gaudi_fsdp: restored the .*", resumed.proc.stdout + resumed.proc.stderr)
    assert len(notes) == 1, notes
    assert re.fullmatch(
        rf"lightning_gaudi_fsdp: restored the {fmt} checkpoint {re.escape(repr(str(ckpt)))} "
        r"\(\d+\.\d (KiB|MiB) on disk, read by 2 rank\(s\)\) in \d+\.\d s: \d+\.\d (KiB|MiB|GiB)/s",
        notes[0],
    ), notes


def _trained(run) -> dict[int, dict[int, list[int]]]:
    """What each rank of a run trained on: rank -> {global step after the batch: the batch's sample indices}."""
    return {
        r: {step: idx for step, idx in json.loads((run.out / f"rank{r}.json").read_text())["trained"]} for r in (0, 1)
    }


# Later-epoch resume: 3 shuffled epochs of 4 steps; saved after the last batch of the second epoch (step 8) and after
# the first batch of the third (step 9), by the run that goes on to the end without stopping.
LATER_SAVES = (2 * STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH + 1)


def resumes_in_a_later_epoch(
    scenario, tmp_path: Path, strategy: dict, saves=LATER_SAVES, defaults=False, preempt_after: int | None = None
) -> None:
    """A run of 3 shuffled epochs through torchdata's ``StatefulDataLoader`` saves at each step of ``saves`` (as
    ModelCheckpoint's ``every_n_train_steps`` would); each resume from one of them trains, from the next step on,
    the samples the uninterrupted run trained there, on each rank, and ends bitwise equal to it. ``defaults``: on
    Lightning's defaults (its logger, its ModelCheckpoint, the progress bar, validation, ``default_root_dir``).
    ``preempt_after``: instead, a SIGTERM to rank 1 after that step; the preemption save (``last.ckpt``, a step or two
    later) is the checkpoint resumed."""
    module = _module(stateful_loader=True, shuffle=True)
    root = tmp_path / "root"
    trainer = {**LIGHTNING_DEFAULTS, "default_root_dir": str(root)} if defaults else {}
    base = {"strategy": strategy, "module": module, "max_steps": 3 * STEPS_PER_EPOCH, "trainer": trainer}
    if preempt_after is None:
        checkpoints = {step: str(tmp_path / f"step{step}.ckpt") for step in saves}
        paths = {str(step): path for step, path in checkpoints.items()}
        straight = scenario({**base, "save_at_step": list(saves), "save_paths_in_loop": paths})
    else:  # Lightning's default ModelCheckpoint without a logger: last.ckpt in <default_root_dir>/checkpoints
        straight = scenario(base)
        base["trainer"] = {**trainer, "enable_checkpointing": True, "default_root_dir": str(root)}
        signal = {"step": preempt_after, "to": "rank1", "delay": 0.02}
        preempted = scenario({**base, "sigterm": signal}, expect_ok=False)
        assert preempted.proc.returncode == 75, preempted.proc.stderr[-6000:]
        ckpt = root / "checkpoints" / "last.ckpt"
        checkpoints = {describe(ckpt)["global_step"]: str(ckpt)}
        assert preempt_after < min(checkpoints) < 3 * STEPS_PER_EPOCH, checkpoints
    order = _trained(straight)
    assert sorted(order[0]) == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    epochs = [[order[0][1 + e * STEPS_PER_EPOCH + i] for i in range(STEPS_PER_EPOCH)] for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2], epochs  # shuffled: each epoch has its own order
    for step, path in checkpoints.items():
        resumed = scenario({**base, "ckpt_path": path})
        trained = _trained(resumed)
        for rank in (0, 1):
            first = min(trained[rank])
            assert (first, trained[rank][first]) == (step + 1, order[rank][step + 1]), (step, rank, trained[rank])
            assert trained[rank] == {s: idx for s, idx in order[rank].items() if s > step}, (step, rank)
        _assert_same_run(resumed.final(), straight.final())
        if defaults:  # the resumed run logged into a version of its own, the default progress bar drew its epochs
            assert "Epoch 2/" in resumed.proc.stdout, resumed.proc.stdout[-2000:]
    if defaults:
        logs = root / "lightning_logs"
        assert sorted(p.name for p in logs.iterdir()) == [f"version_{i}" for i in range(1 + len(saves))]
        # Lightning's ModelCheckpoint saved at each epoch's end and kept the newest, in the strategy's format
        (kept,) = (logs / "version_0" / "checkpoints").iterdir()
        assert kept.name == f"epoch=2-step={3 * STEPS_PER_EPOCH}.ckpt"
        assert describe(kept)["global_step"] == 3 * STEPS_PER_EPOCH
        assert describe(kept)["format"] == strategy["state_dict_type"]


LATER_EPOCH_CASES = [
    pytest.param("sharded", 1, id="sharded-fsdp1-lightning-defaults"),
    pytest.param("local", 1, marks=pytest.mark.slow, id="local-fsdp1"),
    pytest.param("sharded", 2, marks=[pytest.mark.slow, pytest.mark.fsdp2], id="sharded-fsdp2"),
    pytest.param("local", 2, marks=[pytest.mark.slow, pytest.mark.fsdp2], id="local-fsdp2"),
    pytest.param("full", 1, marks=pytest.mark.slow, id="full-fsdp1"),
]


@pytest.mark.parametrize(("fmt", "engine"), LATER_EPOCH_CASES)
def test_mid_epoch_resume_in_a_later_epoch_equals_uninterrupted_run(scenario, tmp_path, fmt, engine):
    """The loader's saved position is applied in the resumed epoch's order, not in the first epoch's, and a position
    saved after an epoch's last batch starts the next epoch instead of skipping it (see ``resume_train_loaders``)."""
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine}
    resumes_in_a_later_epoch(scenario, tmp_path, strategy, defaults=(fmt, engine) == ("sharded", 1))


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "engine"), [("sharded", 2), ("local", 1)])
def test_preempted_in_a_later_epoch_resumes_exactly(scenario, tmp_path, fmt, engine):
    """The same with the preemption save: a SIGTERM to rank 1 after step 8 (the second epoch's last), saved a step or
    two later, in the third epoch."""
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine, "preemption_grace": 20}
    resumes_in_a_later_epoch(scenario, tmp_path, strategy, preempt_after=2 * STEPS_PER_EPOCH)


ASYNC_CASES = [("full", 1), ("sharded", 1), ("local", 1), ("sharded", 2), ("local", 2)]


@pytest.mark.versions
@pytest.mark.parametrize(("fmt", "engine"), ASYNC_CASES)
def test_async_save_holds_the_state_of_its_step_and_resumes_exactly(scenario, tmp_path, uninterrupted, fmt, engine):
    """async_save=True: the checkpoint of step k is written while training goes on to 2k (each write first waits for
    a later step to change the weights), and it still holds step k: resuming from it ends exactly as the run that
    never stopped, as does the run that saved. The copies of parameters and optimizer state start 0.5 s late: the
    next optimizer step waits for them."""
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "fsdp_version": engine, "async_save": True}
    k = STEPS_PER_EPOCH
    straight = uninterrupted(strategy, _module())
    ckpt = tmp_path / "ckpt"
    first = scenario(
        {
            "strategy": strategy,
            "module": _module(),
            "max_steps": 2 * k,
            "writes_after_a_later_step": 15,  # at most; a write begun after the last step goes on when training ends
            "slow_copies": 0.5,  # the next optimizer step must wait for the copies (else the save fails)
            **_save_at(k, ckpt),
        }
    )
    _assert_same_run(first.final(), straight)  # saving in the background did not disturb training
    assert re.search(rf"state_dict_type +: {fmt}, saved in the background", first.proc.stderr)  # fit-start table
    for rank in (0,) if fmt == "full" else (0, 1):  # a full checkpoint is written by rank 0 alone
        writes = json.loads((first.out / f"writes{rank}.json").read_text())
        assert writes
        assert min(writes) > k, writes  # every write began after a later step
    if fmt == "full":  # rank 0 streamed it from the other rank's staged pieces, in the background
        assert json.loads((first.out / "streamed0.json").read_text()) == 1
        assert not _streamed(first)  # ... after save_checkpoint had returned
    for rank in (0, 1):
        # Each rank's shards of parameters and AdamW state were copied while the next step's forward and backward
        # ran; for full, the pieces it sends to rank 0, which streams the file from those copies in the background.
        (save,) = json.loads((first.out / f"saves{rank}.json").read_text())
        assert save["deferred_bytes"] > 0.9 * save["staged_bytes"], save
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # committed, nothing staged left
    resumed = scenario({"strategy": strategy, "module": _module(), "max_steps": 2 * k, "ckpt_path": str(ckpt)})
    _assert_same_run(resumed.final(), straight)


def _assert_close_nested(a, b, path="") -> None:
    _assert_equal_nested(a, b, path, close=True)


@pytest.mark.fsdp2
@pytest.mark.versions
@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize(("writer", "reader"), [(1, 2), (2, 1)])
def test_checkpoints_cross_engines(scenario, tmp_path, uninterrupted, fmt, writer, reader):
    """Switch fsdp_version mid-training: the other engine resumes weights, AdamW state, scheduler and step."""
    base = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt}
    k = STEPS_PER_EPOCH
    straight = uninterrupted({**base, "fsdp_version": writer}, _module())
    ckpt = tmp_path / "ckpt"
    scenario({"strategy": {**base, "fsdp_version": writer}, "module": _module(), "max_steps": k, **_save_at(k, ckpt)})
    resumed = scenario(
        {"strategy": {**base, "fsdp_version": reader}, "module": _module(), "max_steps": 2 * k, "ckpt_path": str(ckpt)}
    ).final()
    assert (resumed["step"], resumed["epoch"], resumed["lr"]) == (straight["step"], straight["epoch"], straight["lr"])
    _assert_close_nested(resumed["weights"], straight["weights"], "weights")
    _assert_close_nested(resumed["optimizer"], straight["optimizer"], "optimizer")
    _assert_equal_nested(resumed["schedulers"], straight["schedulers"], "schedulers")


@pytest.mark.parametrize("fmt", ["full", "sharded", "local"])
def test_use_orig_params_false_resumes_exactly(scenario, tmp_path, uninterrupted, fmt):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt, "use_orig_params": False}
    k = STEPS_PER_EPOCH
    straight = uninterrupted(strategy, _module())
    ckpt = tmp_path / "ckpt"
    scenario({"strategy": strategy, "module": _module(), "max_steps": k, **_save_at(k, ckpt)})
    resumed = scenario({"strategy": strategy, "module": _module(), "max_steps": 2 * k, "ckpt_path": str(ckpt)})
    _assert_same_run(resumed.final(), straight)


@pytest.mark.parametrize("fmt", ["full", "sharded", "local"])
def test_sgd_without_momentum_resumes(scenario, tmp_path, uninterrupted, fmt):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt}
    module = _module(optimizer="sgd")
    k = STEPS_PER_EPOCH
    straight = uninterrupted(strategy, module)
    ckpt = tmp_path / "ckpt"
    scenario({"strategy": strategy, "module": module, "max_steps": k, **_save_at(k, ckpt)})
    resumed = scenario({"strategy": strategy, "module": module, "max_steps": 2 * k, "ckpt_path": str(ckpt)})
    _assert_same_run(resumed.final(), straight)


@pytest.mark.parametrize("async_save", [False, True])
def test_model_checkpoint_last_and_top_k_then_ckpt_path_last(scenario, tmp_path, uninterrupted, async_save):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "sharded", "async_save": async_save}
    k = STEPS_PER_EPOCH
    dirpath = tmp_path / "ckpts"
    callback = {
        "dirpath": str(dirpath),
        "save_last": True,
        "save_top_k": 2,
        "monitor": "train_loss",
        "every_n_train_steps": 2,
    }
    straight = uninterrupted(strategy, _module())
    scenario({"strategy": strategy, "module": _module(), "max_steps": k, "model_checkpoint": callback})
    saved = sorted(p.name for p in dirpath.iterdir())
    assert "last.ckpt" in saved
    assert len([n for n in saved if n != "last.ckpt" and not n.startswith(".")]) == 2  # top-k kept exactly two
    assert not [n for n in saved if n.startswith(".")]  # no staging leftovers
    resumed = scenario(
        {
            "strategy": strategy,
            "module": _module(),
            "max_steps": 2 * k,
            "ckpt_path": "last",
            "model_checkpoint": callback,
        }
    )
    _assert_same_run(resumed.final(), straight)


def test_weights_only_checkpoint_restores_weights(scenario, tmp_path):
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "sharded"}
    dirpath = tmp_path / "w"
    callback = {"dirpath": str(dirpath), "save_weights_only": True, "filename": "weights", "save_last": False}
    first = scenario({"strategy": strategy, "module": _module(), "max_steps": 4, "model_checkpoint": callback})
    saved = torch.load(dirpath / "weights.ckpt" / "meta.pt", weights_only=False)
    assert "optimizer_states" not in saved
    assert first.final()["step"] == 4
    # it holds the weights: consolidated and loaded into a fresh plain module, they are the run's, bitwise
    sys.path.insert(0, str(__import__("conftest").SCENARIOS))
    from common import Module

    from lightning_gaudi_fsdp.checkpoint.convert import convert

    assert convert(dirpath / "weights.ckpt", tmp_path / "weights.full", "full") == []
    fresh = Module()
    fresh.load_state_dict(torch.load(tmp_path / "weights.full", weights_only=False)["state_dict"])
    loaded = {k.removeprefix("net."): v for k, v in fresh.state_dict().items()}
    assert sorted(loaded) == sorted(first.final()["weights"])
    for key, value in first.final()["weights"].items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("use_orig_params", [pytest.param(True, marks=VERSIONS), False])
def test_sharded_checkpoint_reshards_from_two_ranks_to_one(scenario, tmp_path, use_orig_params):
    """Saved by 2 ranks, resumed by 1, where FSDP1 runs NO_SHARD: the one rank reads the checkpoint straight into its
    flat parameters and optimizer state (not through torch's ``dcp.load``), and the run goes on exactly as it does
    from the same state in a full checkpoint (loaded by torch's full-state path)."""
    from lightning_gaudi_fsdp.checkpoint.convert import convert

    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "sharded", "use_orig_params": use_orig_params}
    sharded, full = tmp_path / "sharded", tmp_path / "full"
    scenario({"strategy": strategy, "module": _module(), "max_steps": 4, "save_path": str(sharded)})
    assert convert(sharded, full, "full") == []
    one = {"devices": 1, "strategy": strategy, "module": _module(), "max_steps": 8}
    from_sharded = scenario({**one, "ckpt_path": str(sharded)})
    from_full = scenario({**one, "ckpt_path": str(full)})
    assert json.loads((from_sharded.out / "sharded_loads0.json").read_text()) == {"fast": 1, "torch": 0}
    _assert_same_run(from_sharded.final(), from_full.final())
    assert from_sharded.final()["step"] == 8


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("writer", ["lightning", "ours"])
def test_checkpoints_cross_between_lightning_fsdp_strategy_and_ours(scenario, tmp_path, uninterrupted, fmt, writer):
    """Lightning's own FSDPStrategy writes, we resume (and the other way round): the run ends as if never stopped."""
    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": fmt}
    k = STEPS_PER_EPOCH
    straight = uninterrupted(strategy, _module())
    ckpt = tmp_path / "ckpt"
    stock = {"lightning_stock": True}
    first = {"strategy": strategy, "module": _module(), "max_steps": k, **_save_at(k, ckpt)}
    second = {"strategy": strategy, "module": _module(), "max_steps": 2 * k, "ckpt_path": str(ckpt)}
    written = scenario({**first, **(stock if writer == "lightning" else {})})
    if writer == "ours" and fmt == "full":  # what Lightning's strategy resumes from was written streamed
        assert _streamed(written)
    if writer == "lightning" and fmt == "sharded":  # written by Lightning's code: none of our additions in meta.pt
        assert OPTIMIZER_GROUPS_KEY not in torch.load(ckpt / "meta.pt", weights_only=False)
    resumed = scenario({**second, **(stock if writer == "ours" else {})})
    _assert_same_run(resumed.final(), straight)
    unverified = f"checkpoint '{ckpt}' carries no checksums"
    if writer == "lightning":  # loaded as before, with one line saying it was not verified
        assert (resumed.out / "rank0.stderr").read_text().count(unverified) == 1
        assert unverified not in (resumed.out / "rank1.stderr").read_text()
    else:  # ours carries checksums, and Lightning's strategy reads it all the same
        assert integrity.verify(ckpt)


@pytest.mark.versions
@pytest.mark.parametrize(
    ("to", "use_orig_params", "engine"), [("sharded", True, 1), ("full", False, 1), ("sharded", True, 2)]
)
def test_local_checkpoint_converted_offline_resumes_exactly(
    scenario, tmp_path, uninterrupted, to, use_orig_params, engine
):
    """The way to leave a local checkpoint: convert it (here to each target, each optimizer layout, each engine),
    then resume; the optimizer state is joined from every rank's slices, so the run ends as if never stopped."""
    from lightning_gaudi_fsdp.checkpoint.convert import convert, describe

    strategy = {"auto_wrap_policy": [BLOCK], "state_dict_type": "local", "use_orig_params": use_orig_params}
    strategy["fsdp_version"] = engine
    k = STEPS_PER_EPOCH
    straight = uninterrupted(strategy, _module())
    local, converted = tmp_path / "local", tmp_path / f"converted-{to}"
    scenario({"strategy": strategy, "module": _module(), "max_steps": k, **_save_at(k, local)})
    assert describe(local)["engine"] == f"FSDP{engine}"
    assert convert(local, converted, to) == []  # nothing dropped
    resumed = scenario({"strategy": strategy, "module": _module(), "max_steps": 2 * k, "ckpt_path": str(converted)})
    _assert_same_run(resumed.final(), straight)
    _without_optimizer_names_converts_the_weights_with_a_note(local, converted, to, tmp_path)


def _without_optimizer_names_converts_the_weights_with_a_note(local: Path, converted: Path, to: str, tmp: Path) -> None:
    """A local checkpoint that does not name its optimizer parameters (written by an older version): the command
    converts the weights and says, in one note, that the optimizer state was left out; the same on either engine."""
    import shutil

    from lightning_gaudi_fsdp.checkpoint.convert import load_full_state
    from lightning_gaudi_fsdp.checkpoint.formats import LOCAL_METADATA
    from lightning_gaudi_fsdp.cli import main

    unnamed, target = tmp / "unnamed", tmp / f"unnamed-{to}"
    shutil.copytree(local, unnamed)
    meta = json.loads((unnamed / LOCAL_METADATA).read_text())
    del meta["optimizer_param_names"]
    (unnamed / LOCAL_METADATA).write_text(json.dumps(meta))
    (unnamed / integrity.MANIFEST).unlink()  # an older version wrote no checksums either
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["convert", str(unnamed), str(target), "--to", to])
    assert code == 0, err.getvalue()
    assert re.findall(r"note: [^\n]*", err.getvalue()) == [
        "note: " + integrity.NOT_VERIFIED.format(path=str(unnamed)),
        "note: this local checkpoint does not name its optimizer parameters; its optimizer state was not converted",
    ]
    weights_only, _ = load_full_state(target)
    assert "optimizer_states" not in weights_only
    _assert_equal_nested(weights_only["state_dict"], load_full_state(converted)[0]["state_dict"], "state_dict")
